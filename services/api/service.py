"""Serving the API with uvicorn inside the service runtime."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Generator

import uvicorn

from services.api.app import create_app
from services.api.settings import ApiSettings
from services.common.runtime import ServiceContext, supervise
from services.common.unit_of_work import Work


class _Server(uvicorn.Server):
    """The service runtime owns SIGINT/SIGTERM; uvicorn must not take them over."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


async def run_api(ctx: ServiceContext, stop: asyncio.Event, *, host: str, port: int,
                  settings: ApiSettings | None = None) -> None:
    api = settings or ApiSettings()
    app = create_app(ctx.db(), settings=ctx.settings, api=api, nc=ctx.nc, js=ctx.js)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                            ssl_certfile=api.api_tls_cert, ssl_keyfile=api.api_tls_key)
    server = _Server(config)
    work: Work = app.state.work

    async def serve() -> None:
        task = asyncio.create_task(server.serve())
        try:
            await stop.wait()
        finally:
            server.should_exit = True
            await task

    await supervise(serve(), work.relay(stop))  # the relay: what a route's flush could not send
