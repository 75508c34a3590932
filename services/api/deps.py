"""What routes share: the request's unit of work (its session and outbox), the bus (optional)
and the settings."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncSession

from services.api.errors import Problem, Unavailable
from services.api.settings import ApiSettings
from services.common.settings import Settings
from services.common.unit_of_work import UnitOfWork, Work


@dataclass
class Bus:
    """The API's NATS connection; absent in tests that exercise the database alone."""

    nc: NATS | None
    js: JetStreamContext | None

    def jetstream(self) -> JetStreamContext:
        if self.js is None:
            raise Unavailable("this API process has no connection to NATS")
        return self.js


# A read answers from one snapshot of the database. An answer takes several statements (the
# incidents, then their timelines; an incident, then its plans and audit trail), and under
# Postgres's default READ COMMITTED a commit landing between two of them made an incident's
# timeline say "localized" beside the kind and status from before it (CI saw kind "slowdown",
# status "detected"). REPEATABLE READ fixes the snapshot at the first statement; READ ONLY
# turns a read route that wrote into an error rather than an occasional serialization failure.
SNAPSHOT: dict[str, Any] = {"isolation_level": "REPEATABLE READ", "postgresql_readonly": True}
READS = frozenset({"GET", "HEAD"})


async def unit_dep(request: Request) -> AsyncIterator[UnitOfWork]:
    """One unit of work per request: it commits once the route returned without an error and
    before the answer goes out (a commit that fails is the answer), then sends what the route
    staged (services.common.unit_of_work); an error rolls everything back. A read's unit is
    one read-only snapshot (SNAPSHOT); a write's reads what others committed before each of
    its statements, so that it waits on the rows it locks rather than failing on them."""
    work: Work = request.app.state.work
    async with work.unit() as uow:
        if request.method in READS:
            await uow.session.connection(execution_options=SNAPSHOT)
        yield uow


def session_dep(uow: Annotated[UnitOfWork, Depends(unit_dep, scope="function")]
                ) -> AsyncSession:
    """The request's unit of work's session (the same unit for every dependency of one
    request), for routes that only read and write rows."""
    return uow.session


def bus_dep(request: Request) -> Bus:
    bus: Bus = request.app.state.bus
    return bus


def settings_dep(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def api_settings_dep(request: Request) -> ApiSettings:
    settings: ApiSettings = request.app.state.api_settings
    return settings


Unit = Annotated[UnitOfWork, Depends(unit_dep, scope="function")]
Session = Annotated[AsyncSession, Depends(session_dep, scope="function")]
BusDep = Annotated[Bus, Depends(bus_dep)]
SettingsDep = Annotated[Settings, Depends(settings_dep)]
ApiSettingsDep = Annotated[ApiSettings, Depends(api_settings_dep)]


def problems(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI declarations of a route's error answers (the content type is set in openapi.py)."""
    text = {400: "bad request", 401: "no valid token", 403: "role too weak",
            404: "no such object", 409: "conflicts with the object's state",
            422: "invalid request", 503: "a dependency is unavailable"}
    return {c: {"model": Problem, "description": text.get(c, "error")} for c in codes}
