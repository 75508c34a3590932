"""The analyzer's service tests: the analyzer on its own bus user, with a fresh database; the
stand-in agents each as its own agent user; the operator to look at what was published."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.common.bus.auth import agent_user
from services.common.bus.client import BusClient
from services.common.runtime import ServiceContext
from tests.conftest import Bus
from tests.services.analyzer.helpers import AGENTS


@pytest.fixture()
async def ctx(own_bus: Bus, fresh_db_url: str) -> AsyncIterator[ServiceContext]:
    async with own_bus.service("analyzer", fresh_db_url) as c:
        yield c


@pytest.fixture()
async def agents(own_bus: Bus) -> AsyncIterator[dict[str, BusClient]]:
    """A connection per stand-in agent, as that agent's user."""
    conns = {a: await own_bus.connect(agent_user(a)) for a in AGENTS}
    yield conns
    for nc in conns.values():
        await nc.close()


@pytest.fixture()
async def operator(own_bus: Bus) -> AsyncIterator[BusClient]:
    nc = await own_bus.connect()
    yield nc
    await nc.close()
