"""A webhook receiver on loopback that runs the check docs/webhooks.md documents: verify the
signature and its timestamp, then process each idempotency key once. It can be told to fail
(answer 500) or be stopped and started again on the same port (down, then back)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from services.common.webhooks.signing import (
    DELIVERY_HEADER,
    SIGNATURE_HEADER,
    ReplayGuard,
    SignatureError,
    verify,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Received:
    key: str
    event: str
    body: dict[str, Any]
    headers: dict[str, str]
    raw: bytes


@dataclass
class Receiver:
    secret: str
    port: int = field(default_factory=free_port)
    fail_next: int = 0
    stall_next_s: float = 0.0
    processed: list[Received] = field(default_factory=list)
    requests: int = 0
    rejected: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    guard: ReplayGuard = field(default_factory=ReplayGuard)
    _server: uvicorn.Server | None = None
    _task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def _hook(self, request: Request) -> JSONResponse:
        self.requests += 1
        raw = await request.body()
        if self.stall_next_s > 0:  # answer too late: the sender has given up by then
            stall, self.stall_next_s = self.stall_next_s, 0.0
            await asyncio.sleep(stall)
        if self.fail_next > 0:
            self.fail_next -= 1
            return JSONResponse({"error": "busy"}, status_code=500)
        # --- the documented receiver check -------------------------------------------------
        key = request.headers.get(DELIVERY_HEADER, "")
        try:  # v2: the key it de-duplicates on is signed too
            verify(self.secret, request.headers.get(SIGNATURE_HEADER, ""), raw, delivery=key)
        except SignatureError as exc:
            self.rejected.append(str(exc))
            return JSONResponse({"error": str(exc)}, status_code=401)
        if not self.guard.first_time(key):
            self.duplicates.append(key)
            return JSONResponse({"ok": True, "duplicate": True})
        # ------------------------------------------------------------------------------------
        body = json.loads(raw)
        self.processed.append(Received(key, body.get("event", ""), body, dict(request.headers),
                                       raw))
        return JSONResponse({"ok": True})

    async def start(self) -> None:
        app = Starlette(routes=[Route("/hook", self._hook, methods=["POST"])])
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="off")
        self._server = uvicorn.Server(config)
        self._server.capture_signals = contextlib.nullcontext
        self._task = asyncio.create_task(self._server.serve())
        for _ in range(200):
            if self._server.started:
                return
            await asyncio.sleep(0.02)
        raise RuntimeError("receiver did not start")

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
        self._server = self._task = None
