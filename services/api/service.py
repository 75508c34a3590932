"""Serving the API with uvicorn inside the service runtime."""

from __future__ import annotations

import asyncio

import uvicorn

from services.api.app import create_app
from services.common.runtime import ServiceContext


async def run_api(ctx: ServiceContext, stop: asyncio.Event, *, host: str, port: int) -> None:
    app = create_app(ctx.db())
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve())
    await stop.wait()
    server.should_exit = True
    await task
