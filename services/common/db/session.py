"""Engine and session factory; sessions are used through units of work
(services.common.unit_of_work), which commit them."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

from services.common.embedded import asyncpg_url
from services.common.settings import Settings

POOL_SIZE: int = Settings.model_fields["database_pool_size"].default
MAX_OVERFLOW: int = Settings.model_fields["database_max_overflow"].default


def make_engine(url: str, *, pool_size: int = POOL_SIZE,
                max_overflow: int = MAX_OVERFLOW) -> AsyncEngine:
    """An engine on ``url`` (one host, or several as libpq writes them: embedded.asyncpg_url)
    keeping ``pool_size`` connections, and ``max_overflow`` more while busy (a service's come
    from its settings: GREYHOUND_DATABASE_POOL_SIZE, GREYHOUND_DATABASE_MAX_OVERFLOW)."""
    return create_async_engine(asyncpg_url(url), pool_pre_ping=True, pool_size=pool_size,
                               max_overflow=max_overflow)


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)
