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


def make_engine(url: str) -> AsyncEngine:
    return create_async_engine(asyncpg_url(url), pool_pre_ping=True, pool_size=5, max_overflow=5)


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)
