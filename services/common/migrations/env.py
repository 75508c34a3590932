"""Alembic environment: async engine, one advisory lock so concurrent service starts migrate once.

The lock is the transaction's own (``pg_advisory_xact_lock``), taken inside the migrations'
transaction and released by its commit. A session lock released before the commit (as it
was) let a second process take it, read the version table the first had not committed yet
and run the same migrations again, failing on tables that were being made.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from services.common.db.migrate import MIGRATION_LOCK
from services.common.db.models import Base
from services.common.embedded import asyncpg_url


def _run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=Base.metadata, compare_type=True)
    with context.begin_transaction():
        connection.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK})
        context.run_migrations()


async def _run_async() -> None:
    url = context.config.get_main_option("sqlalchemy.url")
    assert url, "sqlalchemy.url must be set by the caller"
    engine = create_async_engine(asyncpg_url(url))
    async with engine.connect() as conn:
        await conn.run_sync(_run)
    await engine.dispose()


asyncio.run(_run_async())
