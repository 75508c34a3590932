"""Migrations on a fresh embedded Postgres: up, idempotent, down and up again."""

from __future__ import annotations

import asyncio

import asyncpg

from services.common.db.migrate import upgrade
from services.common.db.models import Base


def _tables(url: str) -> set[str]:
    async def q() -> set[str]:
        conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://", 1))
        try:
            rows = await conn.fetch("select tablename from pg_tables where schemaname='public'")
        finally:
            await conn.close()
        return {r["tablename"] for r in rows}

    return asyncio.run(q())


def test_upgrade_creates_every_model_table(fresh_db_url: str) -> None:
    assert _tables(fresh_db_url) == set()
    upgrade(fresh_db_url)
    tables = _tables(fresh_db_url)
    assert set(Base.metadata.tables) <= tables
    assert "alembic_version" in tables


def test_upgrade_is_idempotent_and_reversible(fresh_db_url: str) -> None:
    from alembic import command

    from services.common.db.migrate import alembic_config

    upgrade(fresh_db_url)
    upgrade(fresh_db_url)
    command.downgrade(alembic_config(fresh_db_url), "base")
    assert _tables(fresh_db_url) == {"alembic_version"}
    upgrade(fresh_db_url)
    assert set(Base.metadata.tables) <= _tables(fresh_db_url)


def test_models_match_migrations(fresh_db_url: str) -> None:
    """Autogenerate against the migrated schema must find nothing left to do."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from sqlalchemy.ext.asyncio import create_async_engine

    upgrade(fresh_db_url)

    async def diff() -> list[object]:
        engine = create_async_engine(fresh_db_url)
        async with engine.connect() as conn:
            result: list[object] = await conn.run_sync(
                lambda c: compare_metadata(MigrationContext.configure(c), Base.metadata))
        await engine.dispose()
        return result

    assert asyncio.run(diff()) == []


async def test_the_migration_lock_is_held_until_the_schema_is_committed(
        fresh_db_url: str) -> None:
    """Another process that gets the migration lock must find the schema committed. The
    migrations here are slowed down right after their last statement (the version row): a
    lock released before the commit (a session lock unlocked, as it was) is free then, with the
    version table not yet visible, and a second service starting would migrate again."""
    import threading
    import time

    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    from services.common.db.migrate import MIGRATION_LOCK, upgrade

    def slow_down(conn: object, cursor: object, statement: str, *_: object) -> None:
        if ("alembic_version" in statement and statement.lstrip().upper().startswith(
                ("INSERT", "UPDATE"))) or "pg_advisory_unlock" in statement:
            time.sleep(1.5)

    event.listen(Engine, "after_cursor_execute", slow_down)
    worker = threading.Thread(target=upgrade, args=(fresh_db_url,))
    try:
        worker.start()
        conn = await asyncpg.connect(fresh_db_url.replace("postgresql+asyncpg://",
                                                          "postgresql://", 1))
        try:
            deadline = time.monotonic() + 120
            while not await conn.fetchval(  # until the migrations hold it
                    "select exists (select from pg_locks where locktype = 'advisory' and "
                    "objid = $1 and granted)", MIGRATION_LOCK):
                assert time.monotonic() < deadline, "the migrations never took their lock"
                await asyncio.sleep(0.01)
            while not await conn.fetchval("select pg_try_advisory_lock($1)", MIGRATION_LOCK):
                assert time.monotonic() < deadline, "the migration lock was never released"
                await asyncio.sleep(0.05)
            seen = await conn.fetchval("select to_regclass('public.alembic_version') is not "
                                       "null and exists (select from alembic_version)")
            await conn.execute("select pg_advisory_unlock($1)", MIGRATION_LOCK)
        finally:
            await conn.close()
        assert seen, "the lock was free before the schema was committed"
    finally:
        worker.join(120)
        event.remove(Engine, "after_cursor_execute", slow_down)
