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
