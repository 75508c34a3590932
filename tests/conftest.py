"""Shared fixtures: real embedded NATS and Postgres, each in a fresh temporary data directory."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from services.common.db.migrate import upgrade_async
from services.common.db.session import make_engine, make_sessionmaker
from services.common.embedded import EmbeddedNats, EmbeddedPostgres


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="gh-nats-") as d:
        server = EmbeddedNats(Path(d), auth=False)  # an open bus: these tests connect without users
        url = server.start()
        yield url
        server.stop()


@pytest.fixture(scope="module")
def own_nats() -> Iterator[str]:
    """A server of the module's own (open, like nats_url): durable consumers the module binds
    start empty, whatever other modules left on the session's server."""
    with tempfile.TemporaryDirectory(prefix="gh-own-nats-") as d:
        server = EmbeddedNats(Path(d), auth=False)
        yield server.start()
        server.stop()


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="gh-pg-") as d:
        server = EmbeddedPostgres(Path(d))
        url = server.start()
        yield url
        server.stop()


@pytest.fixture()
def fresh_db_url(pg_url: str) -> Iterator[str]:
    """A brand-new database on the shared embedded cluster, dropped afterwards."""
    import asyncio
    import uuid

    import asyncpg

    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = pg_url.replace("postgresql+asyncpg://", "postgresql://", 1)

    async def run(sql: str) -> None:
        conn = await asyncpg.connect(admin)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run(f'CREATE DATABASE "{name}"'))
    base, _, query = pg_url.partition("?")
    prefix = base.rsplit("/", 1)[0]
    yield f"{prefix}/{name}" + (f"?{query}" if query else "")
    asyncio.run(run(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture()
async def sessions(fresh_db_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    """Sessions on a fresh database with every migration applied."""
    await upgrade_async(fresh_db_url)
    engine = make_engine(fresh_db_url)
    yield make_sessionmaker(engine)
    await engine.dispose()
