"""The validator's pause is a lease sized to its own plan: long enough for the slowest run it
would still wait for (parking, then one benchmark call per GEMM set and per P2P round), a few
seconds more, and no longer, so that the hooks resume by themselves should it die mid-way."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from nats.aio.msg import Msg

from services.common.bus.client import BusClient
from services.common.bus.contract import ControlRequest, Subjects, Suspicion
from services.common.db.models import Rank
from services.common.runtime import ServiceContext, start_service
from services.common.settings import Settings
from services.validator.service import Validator
from services.validator.settings import ValidatorSettings
from tests.conftest import Bus
from tests.services.validator.test_gpu_bench import (
    AGENT,
    COMM,
    JOB,
    WORLD,
    StandInAgent,
    agent_nc,
)

__all__ = ["agent_nc"]  # the fixture


class LeaseRecorder(StandInAgent):
    def __init__(self) -> None:
        super().__init__()
        self.leases: list[float | None] = []

    async def answer(self, msg: Msg) -> None:
        req = ControlRequest.model_validate_json(msg.data)
        if req.action == "pause":
            self.leases.append(req.lease_s)
        await super().answer(msg)


@pytest.fixture()
async def ctx(bus: Bus) -> AsyncIterator[ServiceContext]:
    """The validator's connection; the stand-in agent answers on its own (``agent_nc``)."""
    c = await start_service("validator", Settings(nats_url=bus.url), need_db=False,
                            backends=bus.backends("validator"))
    yield c
    await c.close()


async def test_the_pause_carries_a_lease_sized_to_the_validation(
ctx: ServiceContext, agent_nc: BusClient) -> None:
    agent = LeaseRecorder()
    subs = [await agent_nc.subscribe(subject, cb=agent.answer)
            for subject in (Subjects.control(JOB, AGENT), Subjects.validation(JOB, AGENT))]
    await agent_nc.flush()  # subscribed before the validator asks, on another connection
    ranks = [Rank(job_id=JOB, rank=r, host="node0", node=0, device=r, pid=10 + r,
                  agent_id=AGENT) for r in range(WORLD)]
    s = Suspicion(job_id=JOB, incident_id="i", kind="mixed_slow", ranks=[2], comm_ids=[COMM])
    config = ValidatorSettings(poll_s=0.01, pause_timeout_s=7, bench_timeout_s=11)
    try:
        run = await Validator(ctx, config).validate(s, ranks)
    finally:
        for sub in subs:
            await sub.unsubscribe()
    assert run.verdict is not None, run.failure
    calls = 1 + run.evidence["p2p_rounds"]  # the GEMMs, then each round of transfers
    assert agent.leases == [7 + 11 * calls + 10]
    assert not agent.paused
