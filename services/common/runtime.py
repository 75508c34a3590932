"""What every service process needs on start: resolved URLs, the bus, the streams, the schema."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from services.common.bus import preflight
from services.common.bus.auth import Credentials, tls_context
from services.common.bus.client import check_streams, connect, ensure_streams, shown
from services.common.bus.grants import GRANTS
from services.common.bus.grants import bus_user as grants_user
from services.common.db.migrate import upgrade_async
from services.common.db.session import make_engine, make_sessionmaker
from services.common.embedded import EmbeddedNats, EmbeddedPostgres
from services.common.outbox import Outbox
from services.common.settings import Settings
from services.common.unit_of_work import Work

log = logging.getLogger(__name__)


@dataclass
class Backends:
    """URLs of the bus and the database, the bus credentials of this process (None: connect
    without), and the embedded servers this process started (if any)."""

    nats_url: str
    database_url: str
    started: list[EmbeddedNats | EmbeddedPostgres] = field(default_factory=list)
    nats_credentials: Credentials | None = None
    embedded_nats: EmbeddedNats | None = None  # started or reused: it hands out credentials

    def stop(self) -> None:
        for server in reversed(self.started):
            server.stop()
        self.started.clear()


def settings_credentials(settings: Settings) -> Credentials | None:
    if settings.nats_user is None or settings.nats_password is None:
        return None
    return Credentials(settings.nats_user, settings.nats_password.get_secret_value())


def resolve_backends(settings: Settings, *, need_db: bool = True,
                     bus_user: str | None = None) -> Backends:
    """Configured URLs win; an unset one starts (or reuses) the embedded server in data_dir.

    Credentials set in the settings win too; without them, ``bus_user``'s come from the
    embedded NATS (created there if it is a new agent's)."""
    started: list[EmbeddedNats | EmbeddedPostgres] = []
    creds = settings_credentials(settings)
    embedded = None
    nats_url = settings.nats_url
    if nats_url is None:
        embedded = EmbeddedNats(settings.data_dir, auth=not settings.nats_no_auth,
                                tracker_partitions=settings.tracker_partitions)
        nats_url = embedded.start()
        started.append(embedded)
        if creds is None and bus_user is not None and embedded.auth:
            creds = embedded.credentials(bus_user)
    db_url = settings.database_url or ""
    if need_db and not db_url:
        pg = EmbeddedPostgres(settings.data_dir)
        db_url = pg.start()
        started.append(pg)
    return Backends(nats_url=nats_url, database_url=db_url, started=started,
                    nats_credentials=creds, embedded_nats=embedded)


@dataclass
class ServiceContext:
    settings: Settings
    backends: Backends
    nc: NATS
    js: JetStreamContext
    engine: AsyncEngine | None
    sessions: async_sessionmaker[AsyncSession] | None

    def db(self) -> async_sessionmaker[AsyncSession]:
        if self.sessions is None:
            raise RuntimeError("this service was started without a database")
        return self.sessions

    def work(self, producer: str, *, ordered: bool = False,
             latest_only: frozenset[str] = frozenset()) -> Work:
        """The service's units of work, announcing through its outbox as ``producer`` (one per
        process: the outbox orders its sends, and its relay runs as one of the tasks)."""
        s = self.settings
        return Work(self.db(), Outbox(self.db(), self.js, producer=producer, ordered=ordered,
                                      poll_s=s.outbox_poll_s, grace_s=s.outbox_grace_s,
                                      latest_only=latest_only))

    async def close(self) -> None:
        try:
            await self.nc.drain()
        except Exception:
            log.debug("nats drain failed on close", exc_info=True)
        if self.engine is not None:
            await self.engine.dispose()
        self.backends.stop()


async def start_service(name: str, settings: Settings, *, need_db: bool = True,
                        backends: Backends | None = None,
                        bus_user: str | None = None) -> ServiceContext:
    """Connect to (or start) NATS and Postgres, check the streams and run migrations.

    ``name`` is a service (services.common.bus.grants has its entry) or a test's own name; its
    bus user is ``bus_user``, by default the service's. A service first checks that its bus
    user may do what its grants say (services.common.bus.preflight: raises MissingGrants, a
    BusAuthError, naming what the server refuses) and checks the streams unless its grants
    say otherwise (the agent may only publish telemetry): a missing one is created, one
    configured otherwise than ``settings`` say raises StreamMismatch and is left as it is
    (``greyhound streams apply`` changes streams; services.common.bus.client.check_stream)."""
    access = GRANTS.get(name)
    if bus_user is None and access is not None:
        bus_user = grants_user(name)
    backends = backends or resolve_backends(settings, need_db=need_db, bus_user=bus_user)
    tls = tls_context(settings.nats_tls_ca, settings.nats_tls_cert, settings.nats_tls_key)
    nc = await connect(backends.nats_url, name=f"greyhound-{name}",
                       credentials=backends.nats_credentials, tls=tls)
    js = nc.jetstream()
    try:
        if access is not None:  # what its grants say its code does, streams declared
            await preflight.check(nc, js, name, access, settings)
        else:
            await check_streams(js, settings)
        engine = sessions = None
        if need_db:
            await upgrade_async(backends.database_url)
            engine = make_engine(backends.database_url, pool_size=settings.database_pool_size,
                                 max_overflow=settings.database_max_overflow)
            sessions = make_sessionmaker(engine)
    except BaseException:
        with contextlib.suppress(Exception):
            await nc.close()
        raise
    user = backends.nats_credentials.user if backends.nats_credentials else "no user"
    log.info("%s connected (nats %s as %s)", name, shown(backends.nats_url), user)
    return ServiceContext(settings, backends, nc, js, engine, sessions)


# Who declares the streams where the settings name no bus user: any central service's user may
# (services.common.bus.grants); the tracker's, whose partitions shape the telemetry stream.
STREAMS_USER = "tracker"
# A stream's creation or change waits for its replicas' raft group: on a loaded cluster that
# takes longer than a request's 5 s, and `streams apply` is run once, on purpose.
APPLY_TIMEOUT_S = 30.0


async def apply_streams(settings: Settings, backends: Backends | None = None) -> dict[str, str]:
    """``greyhound streams apply``: create every stream, or bring it to ``settings`` (its
    replicas, the tracker partitions' subject transform, its limits), once and on purpose,
    before the services start; they only check (services.common.bus.client.check_stream) and
    refuse to start on a stream configured otherwise. What was done to each stream, by name.

    As the settings' bus user, else as STREAMS_USER of the embedded NATS (``backends``, or
    the data directory's, started for the while if it is not running)."""
    own = backends is None
    backends = backends or resolve_backends(settings, need_db=False, bus_user=STREAMS_USER)
    creds = backends.nats_credentials or settings_credentials(settings)
    if creds is None and backends.embedded_nats is not None and backends.embedded_nats.auth:
        creds = backends.embedded_nats.credentials(STREAMS_USER)
    try:
        nc = await connect(backends.nats_url, name="greyhound-streams", credentials=creds,
                           tls=tls_context(settings.nats_tls_ca, settings.nats_tls_cert,
                                           settings.nats_tls_key))
        try:
            return await ensure_streams(nc.jetstream(timeout=APPLY_TIMEOUT_S), settings)
        finally:
            await nc.drain()
    finally:
        if own:
            backends.stop()


class SupervisedTaskCancelled(RuntimeError):
    """A supervised task was cancelled by someone other than its supervisor."""


def _failed(task: asyncio.Future[Any]) -> bool:
    return task.cancelled() or task.exception() is not None


def _name(task: asyncio.Future[Any]) -> str:
    return task.get_name() if isinstance(task, asyncio.Task) else repr(task)


async def supervise(*aws: Awaitable[Any]) -> None:
    """Run a service's tasks together; the first one that dies ends the others and re-raises.

    A task may finish normally (a consumer returns after stop()); supervise returns once all
    did. A task that raises, or is cancelled from outside, cancels the rest, which are awaited,
    and its exception propagates, so the service's main task ends and the process exits for its
    supervisor (``greyhound up``, compose) to restart, instead of living on without the task.
    Cancelling supervise itself cancels every task.
    """
    tasks: list[asyncio.Future[Any]] = [asyncio.ensure_future(aw) for aw in aws]
    for fut, aw in zip(tasks, aws, strict=True):
        if isinstance(fut, asyncio.Task) and fut is not aw and hasattr(aw, "__qualname__"):
            fut.set_name(aw.__qualname__)
    pending: set[asyncio.Future[Any]] = set(tasks)
    dead: list[asyncio.Future[Any]] = []
    try:
        while pending and not dead:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            dead = [t for t in tasks if t in done and _failed(t)]
    finally:
        for fut in pending:
            fut.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    if not dead:
        return
    for other in dead[1:]:
        if not other.cancelled():
            log.error("supervised task %s also failed", _name(other), exc_info=other.exception())
    first = dead[0]
    exc = None if first.cancelled() else first.exception()
    if exc is None:
        raise SupervisedTaskCancelled(f"supervised task {_name(first)} was cancelled")
    log.error("supervised task %s died; the others were stopped", _name(first), exc_info=exc)
    raise exc
