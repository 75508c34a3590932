"""A database URL of several hosts as libpq writes them (a primary and its standbys) works as
given: migrations, the engine, asyncpg trying the hosts in turn; the pool per process is a
setting."""

from __future__ import annotations

from urllib.parse import urlsplit

from sqlalchemy import text

from services.common.embedded import asyncpg_url
from services.common.runtime import Backends, start_service
from services.common.settings import Settings
from tests.conftest import Bus
from tests.services.common.pg_proxy import PgProxy


async def test_a_url_of_two_hosts_reaches_the_one_that_answers(bus: Bus, fresh_db_url: str
                                                                ) -> None:
    """The first host is down (a closed port), the second is the database: a service starts,
    migrates and reads through the URL as an operator writes it, with its own pool size."""
    down, up = PgProxy(fresh_db_url), PgProxy(fresh_db_url)
    await down.start()
    await down.stop()  # its port, closed
    await up.start()
    url = (f"postgresql://postgres@127.0.0.1:{down.port},127.0.0.1:{up.port}"
           f"{urlsplit(up.url).path}?target_session_attrs=read-write")
    settings = Settings(nats_url=bus.url, database_url=url, database_pool_size=2,
                        database_max_overflow=1)
    ctx = await start_service("db-url-test", settings, backends=Backends(
        nats_url=bus.url, database_url=url, nats_credentials=bus.creds("operator")))
    try:
        async with ctx.db()() as session:
            assert (await session.execute(text("select count(*) from alembic_version"))
                    ).scalar_one() == 1
        assert ctx.engine is not None
        pool = ctx.engine.sync_engine.pool
        assert pool.size() == 2 and pool._max_overflow == 1  # type: ignore[attr-defined]
    finally:
        await ctx.close()
        await up.stop()


def test_several_hosts_become_what_sqlalchemy_and_asyncpg_read() -> None:
    assert asyncpg_url("postgresql://u:p@h1:5432,h2/db?target_session_attrs=read-write") == (
        "postgresql+asyncpg://u:p@/db?host=h1%3A5432&host=h2%3A5432"
        "&target_session_attrs=read-write")
    one = "postgresql://u:p@h1:5433/db?sslmode=require"
    assert asyncpg_url(one) == one.replace("postgresql://", "postgresql+asyncpg://")
    socket = "postgresql+asyncpg://postgres@/postgres?host=/run/pg"
    assert asyncpg_url(socket) == socket
    # the password setting goes into a URL of several hosts too
    s = Settings(database_url="postgresql://app@h1:5432,h2:5432/db", database_password="p w")
    assert s.database_url == "postgresql://app:p%20w@h1:5432,h2:5432/db"
    assert (Settings().database_pool_size, Settings().database_max_overflow) == (4, 2)
