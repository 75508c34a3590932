"""The failure classification: a table of the errors services meet, then the real exceptions a
real Postgres raises when it goes away, which are what the old ``except OSError`` missed."""

from __future__ import annotations

import asyncio
import socket
import uuid

import asyncpg.exceptions as pg
import nats.errors as nats_errors
import nats.js.errors as js_errors
import pytest
import sqlalchemy.exc as sa
from pydantic import BaseModel, ValidationError
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from services.common.bus.errors import (
    PermanentError,
    TransientError,
    available,
    classify,
    describe,
)
from services.common.db.session import make_engine, make_sessionmaker
from services.common.embedded import asyncpg_url
from services.common.unit_of_work import Work


class _Model(BaseModel):
    n: int


def _validation_error() -> ValidationError:
    try:
        _Model.model_validate({"n": "x"})
    except ValidationError as exc:
        return exc
    raise AssertionError("validation passed")


def _raised(outer: BaseException, inner: BaseException, *, suppress: bool = False) -> BaseException:
    """``outer`` as raised inside ``except inner`` (from None when ``suppress``)."""
    try:
        try:
            raise inner
        except BaseException:
            if suppress:
                raise outer from None
            raise outer  # noqa: B904 - the implicit context is what is under test
    except BaseException as exc:
        return exc
    raise AssertionError("unreachable")


def _caused(outer: BaseException, cause: BaseException) -> BaseException:
    outer.__cause__ = cause
    return outer


TRANSIENT: list[tuple[str, BaseException]] = [
    ("OSError", OSError("network is unreachable")),
    ("connection refused", ConnectionRefusedError(111, "Connection refused")),
    ("connection reset", ConnectionResetError(104, "Connection reset by peer")),
    ("unix socket gone", FileNotFoundError(2, "No such file or directory")),
    ("TimeoutError", TimeoutError()),
    ("sa OperationalError", sa.OperationalError("select 1", {}, Exception("server closed"))),
    ("sa InterfaceError", sa.InterfaceError("select 1", {}, Exception("connection is closed"))),
    ("sa DBAPIError invalidated", sa.DBAPIError("select 1", {}, Exception("x"),
                                                connection_invalidated=True)),
    ("sa DBAPIError admin shutdown", sa.DBAPIError("select 1", {}, pg.AdminShutdownError("bye"))),
    ("sa pool TimeoutError", sa.TimeoutError("QueuePool limit of size 5 overflow 5 reached")),
    ("sa DisconnectionError", sa.DisconnectionError()),
    ("pg ConnectionDoesNotExist", pg.ConnectionDoesNotExistError("closed mid-operation")),
    ("pg CannotConnectNow", pg.CannotConnectNowError("the database system is starting up")),
    ("pg TooManyConnections", pg.TooManyConnectionsError("too many clients")),
    ("pg AdminShutdown", pg.AdminShutdownError("terminating connection")),
    ("pg Serialization", pg.SerializationError("could not serialize access")),
    ("pg Deadlock", pg.DeadlockDetectedError("deadlock detected")),
    ("pg InterfaceError", pg.InterfaceError("connection is closed")),
    ("nats TimeoutError", nats_errors.TimeoutError()),
    ("nats NoServers", nats_errors.NoServersError()),
    ("nats ConnectionClosed", nats_errors.ConnectionClosedError()),
    ("nats NoResponders", nats_errors.NoRespondersError()),
    ("js fetch timeout", js_errors.FetchTimeoutError()),
    ("js ServiceUnavailable", js_errors.ServiceUnavailableError()),
    ("js APIError 503", js_errors.APIError(code=503, description="JetStream not enabled")),
    ("js no stream response", js_errors.NoStreamResponseError()),
    ("explicit TransientError", TransientError("dependency busy")),
    ("explicit TransientError over a ValueError", _caused(TransientError("busy"), ValueError())),
    ("ValueError from a dropped connection",
     _caused(ValueError("could not save"), sa.DBAPIError("commit", {}, Exception("x"),
                                                         connection_invalidated=True))),
    ("KeyError while handling a reset", _raised(KeyError("k"), ConnectionResetError())),
    ("group with a disconnect", ExceptionGroup("tasks", [ValueError("a"), OSError("b")])),
]

PERMANENT: list[tuple[str, BaseException]] = [
    ("ValueError", ValueError("bad rank")),
    ("KeyError", KeyError("job")),
    ("TypeError", TypeError("not a list")),
    ("pydantic ValidationError", _validation_error()),
    ("sa IntegrityError", sa.IntegrityError("insert", {}, pg.UniqueViolationError("duplicate"))),
    ("sa ProgrammingError", sa.ProgrammingError("selct", {}, Exception("syntax error"))),
    ("sa DBAPIError, connection fine", sa.DBAPIError("select", {}, Exception("division by zero"))),
    ("pg UniqueViolation", pg.UniqueViolationError("duplicate key")),
    ("pg ClientConfigurationError", pg.ClientConfigurationError("bad sslmode")),
    ("js APIError 400", js_errors.BadRequestError(code=400, description="bad request")),
    ("js APIError 404", js_errors.NotFoundError(code=404, description="consumer not found")),
    ("nats MaxPayload", nats_errors.MaxPayloadError()),
    ("explicit PermanentError over an OSError", _caused(PermanentError("give up"), OSError())),
    ("context hidden with from None", _raised(ValueError("bad"), OSError(), suppress=True)),
    ("group of bugs", ExceptionGroup("tasks", [ValueError("a"), KeyError("b")])),
]


@pytest.mark.parametrize(("name", "exc"), TRANSIENT, ids=[n for n, _ in TRANSIENT])
def test_transient(name: str, exc: BaseException) -> None:
    assert classify(exc) == "transient", name


@pytest.mark.parametrize(("name", "exc"), PERMANENT, ids=[n for n, _ in PERMANENT])
def test_permanent(name: str, exc: BaseException) -> None:
    assert classify(exc) == "permanent", name


def test_chain_cycles_end() -> None:
    a, b = ValueError("a"), ValueError("b")
    a.__cause__, b.__cause__ = b, a
    assert classify(a) == "permanent"
    assert describe(a) == "ValueError: a <- ValueError: b"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_real_postgres_failures_are_classified(fresh_db_url: str) -> None:
    """The exceptions SQLAlchemy really raises when Postgres goes away are transient (none of
    the mid-transaction ones is an OSError); a real unique conflict is permanent."""
    engine = make_engine(fresh_db_url)
    killer = make_engine(fresh_db_url)
    seen: dict[str, BaseException] = {}
    try:
        async with engine.connect() as conn:
            pid = (await conn.execute(text("select pg_backend_pid()"))).scalar_one()

            async def terminate() -> None:
                await asyncio.sleep(0.3)
                async with killer.connect() as k:
                    await k.execute(text("select pg_terminate_backend(:p)"), {"p": pid})

            task = asyncio.create_task(terminate())
            with pytest.raises(sa.DBAPIError) as mid_query:
                await conn.execute(text("select pg_sleep(30)"))
            await task
            seen["terminated mid-query"] = mid_query.value
        async with engine.connect() as conn:
            pid = (await conn.execute(text("select pg_backend_pid()"))).scalar_one()
            async with killer.connect() as k:
                await k.execute(text("select pg_terminate_backend(:p)"), {"p": pid})
            await asyncio.sleep(0.2)
            with pytest.raises(sa.DBAPIError) as between:
                await conn.execute(text("select 1"))
            seen["terminated between statements"] = between.value
        for name, exc in seen.items():
            assert not isinstance(exc, OSError), name
            assert classify(exc) == "transient", f"{name}: {describe(exc)}"

        closed = make_engine(f"postgresql://postgres@127.0.0.1:{_closed_port()}/postgres")
        no_socket = make_engine(f"postgresql://postgres@/postgres?host=/nonexistent-{uuid.uuid4().hex}")
        for name, eng in (("closed port", closed), ("no socket", no_socket)):
            with pytest.raises(OSError) as refused:  # a connect failure is a plain OSError
                async with eng.connect() as conn:
                    await conn.execute(text("select 1"))
            await eng.dispose()
            assert classify(refused.value) == "transient", f"{name}: {describe(refused.value)}"

        async with engine.begin() as conn:
            await conn.execute(text("create table once (k text primary key)"))
            await conn.execute(text("insert into once values ('a')"))
        with pytest.raises(sa.IntegrityError) as conflict:
            async with engine.begin() as conn:
                await conn.execute(text("insert into once values ('a')"))
        assert classify(conflict.value) == "permanent"
    finally:
        await engine.dispose()
        await killer.dispose()


async def test_a_read_only_server_is_transient_and_not_writable(fresh_db_url: str) -> None:
    """What a failover can leave a pooled connection on: a standby, read-only (SQLSTATE 25006).
    The write is retried, not dead-lettered, and the consumers' probe says the database is away
    (it was classed permanent: every event of the failover went to the dead-letter queue)."""
    engine = create_async_engine(asyncpg_url(fresh_db_url), connect_args={"server_settings": {
        "default_transaction_read_only": "on"}})
    try:
        with pytest.raises(sa.DBAPIError) as read_only:
            async with engine.begin() as conn:
                await conn.execute(text("create table nope (k int)"))
        assert getattr(read_only.value.orig, "sqlstate", None) == "25006"
        assert classify(read_only.value) == "transient", describe(read_only.value)
        assert await Work(make_sessionmaker(engine)).writable() is False
    finally:
        await engine.dispose()
    writable = make_engine(fresh_db_url)
    try:
        assert await Work(make_sessionmaker(writable)).writable() is True
    finally:
        await writable.dispose()


async def test_available_answers_unavailable_not_error(fresh_db_url: str) -> None:
    up = make_engine(fresh_db_url)
    down = make_engine(f"postgresql://postgres@127.0.0.1:{_closed_port()}/postgres")

    async def ping(engine: AsyncEngine) -> None:
        async with engine.connect() as conn:
            await conn.execute(text("select 1"))

    async def hangs() -> None:
        await asyncio.sleep(60)

    async def bug() -> None:
        raise ValueError("a bug, not an outage")

    try:
        assert await available(lambda: ping(up)) is True
        assert await available(lambda: ping(down)) is False
        assert await available(hangs, timeout_s=0.2) is False
        with pytest.raises(ValueError, match="a bug"):
            await available(bug)
    finally:
        await up.dispose()
        await down.dispose()
