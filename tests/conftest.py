"""Shared fixtures: real embedded NATS and Postgres, each in a fresh temporary data directory.

The bus is the one ``greyhound up`` runs: the embedded NATS with a user per service and per
agent, each with exactly its registry line's permissions (``Bus``). A test connects as the
service it plays (``bus.backends("tracker")`` for start_service, ``bus.connect("agent-a1")`` to
publish an agent's telemetry) and as ``operator`` (every right) only to look at what the
services did: streams, consumers, dead letters.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from services.common.bus.auth import Credentials
from services.common.bus.client import BusClient, connect
from services.common.db.migrate import upgrade_async
from services.common.db.session import make_engine, make_sessionmaker
from services.common.embedded import OPERATOR, EmbeddedNats, EmbeddedPostgres
from services.common.runtime import Backends, ServiceContext, start_service
from services.common.settings import Settings

# The token key of the stacks the tests run on a database of their own (a configured database:
# the API refuses one without a key).
TEST_TOKEN_KEY = "tests-token-key-0123456789"


@dataclass
class Bus:
    """An authenticated embedded NATS and the credentials of its users."""

    server: EmbeddedNats

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def data_dir(self) -> Path:
        return self.server.data_dir

    def creds(self, user: str) -> Credentials:
        """A service's user (its registry name), an agent's (agent-<id>) or ``operator``."""
        return self.server.credentials(user)

    def backends(self, user: str, database_url: str = "") -> Backends:
        """What start_service connects with, as ``user``."""
        return Backends(nats_url=self.url, database_url=database_url,
                        nats_credentials=self.creds(user))

    async def connect(self, user: str = OPERATOR, name: str | None = None) -> BusClient:
        return await connect(self.url, name=name or f"test-{user}", credentials=self.creds(user))

    @contextlib.asynccontextmanager
    async def service(self, name: str, database_url: str = "") -> AsyncIterator[ServiceContext]:
        """The context a service of the registry starts with, as its own bus user (its start-up
        check run), on ``database_url`` (none: a service started without a database)."""
        ctx = await start_service(name, Settings(nats_url=self.url, database_url=database_url or None),
                                  need_db=bool(database_url),
                                  backends=self.backends(name, database_url))
        try:
            yield ctx
        finally:
            await ctx.close()

    def withdraw(self, user: str, subject: str) -> None:
        """The server forgets one publish grant of ``user``, as a server configured from an
        older registry would lack it: its config rewritten and reloaded. (A bus of the test's
        own: a new agent's user makes the server regenerate its config.)"""
        conf = self.data_dir / "nats" / "server.conf"
        head, _, body = conf.read_text().partition("authorization ")
        auth = json.loads(body)
        (entry,) = [e for e in auth["users"] if e["user"] == user]
        entry["permissions"]["publish"]["allow"].remove(subject)
        conf.write_text(f"{head}authorization {json.dumps(auth)}\n")
        pid = json.loads((self.data_dir / "nats" / "server.json").read_text())["pid"]
        os.kill(int(pid), signal.SIGHUP)
        time.sleep(0.5)  # the reload applies to connected clients too; it takes milliseconds


@contextlib.contextmanager
def new_bus(prefix: str, *, tracker_partitions: int = 1) -> Iterator[Bus]:
    """A bus in a fresh temporary data directory (its users' grants for that many tracker
    partitions), stopped on exit."""
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        server = EmbeddedNats(Path(d), tracker_partitions=tracker_partitions)
        server.start()
        try:
            yield Bus(server)
        finally:
            server.stop()


@pytest.fixture(scope="session")
def bus() -> Iterator[Bus]:
    """The session's bus, shared by the modules that do not bind durables of their own."""
    with new_bus("gh-nats-") as b:
        yield b


@pytest.fixture(scope="module")
def own_bus() -> Iterator[Bus]:
    """A bus of the module's own: durable consumers the module binds start empty, whatever
    other modules left on the session's."""
    with new_bus("gh-own-nats-") as b:
        yield b


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="gh-pg-") as d:
        server = EmbeddedPostgres(Path(d))
        url = server.start()
        yield url
        server.stop()


@contextlib.contextmanager
def new_database(pg_url: str, prefix: str = "t") -> Iterator[str]:
    """A brand-new database on the cluster of ``pg_url``, dropped on exit; its URL."""
    import asyncio
    import uuid

    import asyncpg

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = pg_url.replace("postgresql+asyncpg://", "postgresql://", 1)

    async def run(sql: str) -> None:
        conn = await asyncpg.connect(admin)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run(f'CREATE DATABASE "{name}"'))
    base, _, query = pg_url.partition("?")
    try:
        yield f"{base.rsplit('/', 1)[0]}/{name}" + (f"?{query}" if query else "")
    finally:
        asyncio.run(run(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture()
def fresh_db_url(pg_url: str) -> Iterator[str]:
    """A brand-new database on the shared embedded cluster, dropped afterwards."""
    with new_database(pg_url) as url:
        yield url


@pytest.fixture()
async def sessions(fresh_db_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    """Sessions on a fresh database with every migration applied."""
    await upgrade_async(fresh_db_url)
    engine = make_engine(fresh_db_url)
    yield make_sessionmaker(engine)
    await engine.dispose()
