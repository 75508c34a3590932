"""The validator's pause is a lease: its pause budget, so that the hooks resume by themselves
should it die mid-way, and never more than a quarter of the collective timeout the ranks report
(a pause counts toward the collective the rank parked in: PyTorch's watchdog would abort the job
right after the resume). A budget under the minimum is refused: no pause at all."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from nats.aio.msg import Msg

from services.common.bus.client import BusClient
from services.common.bus.contract import ControlRequest, Suspicion
from services.common.db.models import Rank
from services.common.runtime import ServiceContext, start_service
from services.common.settings import Settings
from services.validator.hold import Hold, Run
from services.validator.settings import ValidatorSettings
from tests.conftest import Bus
from tests.services.validator.test_gpu_bench import (
    AGENT,
    COMM,
    JOB,
    WORLD,
    StandInAgent,
    agent_nc,
    serving,
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


async def _validate(ctx: ServiceContext, agent_nc: BusClient, agent: LeaseRecorder,
                    config: ValidatorSettings) -> tuple[Run, list[float | None]]:
    subs = await serving(agent_nc, ctx.nc, agent)
    ranks = [Rank(job_id=JOB, rank=r, host="node0", node=0, device=r, pid=10 + r,
                  agent_id=AGENT) for r in range(WORLD)]
    s = Suspicion(job_id=JOB, incident_id="i", kind="mixed_slow", ranks=[2], comm_ids=[COMM])
    try:
        run = await Hold(ctx.nc, config).validate(s, ranks)
    finally:
        for sub in subs:
            await sub.unsubscribe()
    return run, agent.leases


@pytest.mark.parametrize(("reported", "lease"), [(None, 12.0), (600.0, 12.0), (20.0, 5.0)])
async def test_the_pause_lease_is_the_budget_within_a_quarter_of_the_jobs_timeout(
        ctx: ServiceContext, agent_nc: BusClient, reported: float | None, lease: float) -> None:
    agent = LeaseRecorder()
    agent.job_timeout_s = reported
    run, leases = await _validate(ctx, agent_nc, agent,
                                  ValidatorSettings(poll_s=0.01, pause_budget_s=12))
    assert run.verdict is not None, run.failure
    assert leases == [lease]
    assert run.evidence["pause_budget_s"] == lease
    assert run.evidence["job_timeout_s"] == reported
    assert not agent.paused


async def test_a_timeout_too_short_for_any_pause_is_refused(ctx: ServiceContext,
                                                            agent_nc: BusClient) -> None:
    agent = LeaseRecorder()
    agent.job_timeout_s = 2.0  # a quarter: 0.5 s, under min_pause_s
    run, leases = await _validate(ctx, agent_nc, agent,
                                  ValidatorSettings(poll_s=0.01, min_pause_s=1.0))
    assert leases == [] and not agent.benched  # never paused
    assert run.verdict is None and run.failure is not None and run.failure.startswith("refused:")
