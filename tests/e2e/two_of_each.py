"""What tests/e2e/test_two_of_each.py runs the system with: a 3-node NATS JetStream cluster on
loopback (R3 streams), a database of its own, N instances of each central service started as
``greyhound up`` starts one (stack.up.Stack), the API instances behind a load balancer, and a
webhook receiver on loopback. Kept apart from the test so that the test reads as its scenario
and its comparison."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.services.notifier.receiver import Receiver, free_port

CENTRAL = ("tracker", "analyzer", "validator", "planner", "notifier", "api")


class Balancer(httpx.BaseTransport):
    """A load balancer in front of the API instances: each request goes to the next instance in
    turn, and one that refuses the connection (killed) is passed over, as a balancer's health
    check would. No connection is kept between requests, so a request never meets a killed
    instance's stale socket: a connection refused is one the request never reached."""

    def __init__(self, bases: list[str]) -> None:
        self.bases = list(bases)
        self._next = 0
        self._lock = threading.Lock()
        self._inner = httpx.HTTPTransport(limits=httpx.Limits(max_keepalive_connections=0))

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            first, self._next = self._next, (self._next + 1) % len(self.bases)
        for i in range(len(self.bases)):
            base = httpx.URL(self.bases[(first + i) % len(self.bases)])
            request.url = request.url.copy_with(scheme=base.scheme, host=base.host,
                                                port=base.port)
            try:
                return self._inner.handle_request(request)
            except httpx.ConnectError:
                continue
        raise httpx.ConnectError(f"no API instance answers ({self.bases})", request=request)

    def close(self) -> None:
        self._inner.close()


def balanced(bases: list[str], timeout_s: float = 10.0) -> httpx.Client:
    """A client of the API instances; its requests name the host ``api``."""
    return httpx.Client(base_url="http://api", transport=Balancer(bases), timeout=timeout_s)


@dataclass
class ThreadedReceiver:
    """tests.services.notifier.receiver.Receiver (the documented receiver check: signature,
    then each idempotency key processed once) served from its own event loop thread."""

    secret: str
    receiver: Receiver = field(init=False)
    _loop: asyncio.AbstractEventLoop = field(init=False)
    _thread: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.receiver = Receiver(self.secret, port=free_port())
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="webhook-receiver")
        self._thread.start()
        self._call(self.receiver.start())

    @property
    def url(self) -> str:
        return self.receiver.url

    def _call(self, coro: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    def of_job(self, job: str) -> list[dict[str, Any]]:
        """The bodies processed for ``job`` (an incident's or a plan's), in arrival order."""
        async def copy() -> list[dict[str, Any]]:
            return [r.body for r in self.receiver.processed]

        bodies = asyncio.run_coroutine_threadsafe(copy(), self._loop).result(timeout=10)
        return [b for b in bodies if (b.get("incident") or b.get("plan") or {}).get("job_id")
                == job]

    def duplicates(self) -> list[str]:
        """Idempotency keys sent again after they were processed (at-least-once delivery
        retried: a notifier that died mid-send, or one that stalled past its lease)."""
        return list(self.receiver.duplicates)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._call(self.receiver.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


def dump(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, default=str)
