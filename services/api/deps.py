"""What routes share: the request's database session, the bus (optional) and the settings."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from services.api.errors import Problem, Unavailable
from services.api.settings import ApiSettings
from services.common.bus.client import publish
from services.common.bus.contract import Message
from services.common.settings import Settings


@dataclass
class Bus:
    """The API's NATS connection; absent in tests that exercise the database alone."""

    nc: NATS | None
    js: JetStreamContext | None

    def jetstream(self) -> JetStreamContext:
        if self.js is None:
            raise Unavailable("this API process has no connection to NATS")
        return self.js

    async def announce(self, subject: str, msg: Message) -> bool:
        """Publish after a commit; False (logged by the caller) when there is no bus."""
        if self.js is None:
            return False
        await publish(self.js, subject, msg)
        return True


async def session_dep(request: Request) -> AsyncIterator[AsyncSession]:
    """One session per request: the request is the unit of work, and a write route commits
    once, before anything is published."""
    maker: async_sessionmaker[AsyncSession] = request.app.state.sessions
    async with maker() as session:
        yield session


def bus_dep(request: Request) -> Bus:
    bus: Bus = request.app.state.bus
    return bus


def settings_dep(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def api_settings_dep(request: Request) -> ApiSettings:
    settings: ApiSettings = request.app.state.api_settings
    return settings


Session = Annotated[AsyncSession, Depends(session_dep)]
BusDep = Annotated[Bus, Depends(bus_dep)]
SettingsDep = Annotated[Settings, Depends(settings_dep)]
ApiSettingsDep = Annotated[ApiSettings, Depends(api_settings_dep)]


def problems(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI declarations of a route's error answers (the content type is set in openapi.py)."""
    text = {400: "bad request", 401: "no valid token", 403: "role too weak",
            404: "no such object", 409: "conflicts with the object's state",
            422: "invalid request", 503: "a dependency is unavailable"}
    return {c: {"model": Problem, "description": text.get(c, "error")} for c in codes}
