"""An in-process stack for the validator tests: agent, tracker (it stores the ranks from the
agent's hellos) and validator on their own NATS server and a fresh database per test."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from greyhound.fakejob import native_build_dir
from services.agent.service import run_agent
from services.agent.settings import AgentSettings
from services.common.bus.auth import agent_user
from services.common.bus.client import BusClient, publish
from services.common.bus.contract import IncidentEvent, Subjects, Suspicion
from services.common.db import repository as repo
from services.common.db.documents import Culprit, Empty, Evidence
from services.common.db.models import Incident
from services.common.runtime import ServiceContext, start_service
from services.common.settings import Settings
from services.tracker.service import run_tracker
from services.validator.service import Validator, run_validator
from services.validator.settings import ValidatorSettings, for_cpu_fake
from tests.conftest import Bus

AGENT = "val-agent"


@dataclass
class MiniStack:
    settings: Settings
    ctx: ServiceContext
    validator: Validator
    analyzer: BusClient  # sends the suspicions, as the analyzer does
    events: list[IncidentEvent] = field(default_factory=list)

    async def open_incident(self, job: str) -> str:
        """A localised slowdown incident of ``job``, as the validator finds them."""
        async with self.ctx.db()() as session:
            inc = await repo.open_incident(
                session, job_id=job, kind="slowdown", dedup_key="slowdown", severity=1.5,
                summary=f"job {job} slowdown", culprit=Culprit(ranks=[]), evidence=Evidence(),
                stage_detail=Empty())
            # as the analyzer does before it publishes a suspicion (a detected incident cannot
            # be validated: greyhound.core.lifecycle)
            await repo.add_timeline(session, inc, "localized", Empty())
            await session.commit()
            return inc.id

    async def wait_ranks(self, job: str, n: int, timeout_s: float = 30.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            async with self.ctx.db()() as session:
                if len(await repo.job_ranks(session, job)) >= n:
                    return
            await asyncio.sleep(0.1)
        raise AssertionError(f"the tracker never stored {n} ranks of {job}")

    async def suspect(self, s: Suspicion, timeout_s: float = 60.0) -> Incident:
        """Publish the suspicion and wait for the validator to announce its incident. What it
        names is recorded as the incident's localised culprit first, as the analyzer commits
        it before it publishes (the validator refuses suspicions nothing localised)."""
        async with self.ctx.db()() as session:
            inc = await repo.get_incident_for_update(session, s.incident_id)
            if inc is not None:
                inc.culprit = inc.culprit.model_copy(update={
                    "compute_ranks": list(s.ranks), "comm_ids": list(s.comm_ids)})
                await session.commit()
        await publish(self.analyzer.jetstream(), Subjects.suspicion(s.job_id), s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            async with self.ctx.db()() as session:
                inc = await repo.get_incident(session, s.incident_id)
            if inc is not None and inc.evidence.validation is not None:
                return inc
            await asyncio.sleep(0.1)
        raise AssertionError("the validator did not record a validation")


@pytest.fixture()
def validator_config() -> ValidatorSettings:
    """For the CPU fake NCCL: the demo's settings (GEMMs large enough to rise above the noise
    of a naive SGEMM on 2 shared cores, best of 9, 25%), with the paper's P2P sizes."""
    return for_cpu_fake(ValidatorSettings(p2p_bytes=[16 << 20, 32 << 20, 64 << 20]))


@pytest.fixture()
async def mini_stack(own_bus: Bus, fresh_db_url: str, tmp_path: Path,
                     validator_config: ValidatorSettings,
                     monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[MiniStack]:
    """A bus of the module's own: the durable 'tracker' and 'validator' consumers start empty."""
    # the in-process agent's fake NVML reads the fault file of the job in tmp_path / "w"
    monkeypatch.setenv("FAKE_NCCL_FAULTS", str(tmp_path / "w" / "faults.txt"))
    settings = Settings(nats_url=own_bus.url, database_url=fresh_db_url,
                        shm_dir=tmp_path / "shm", data_dir=tmp_path / "data")
    ctx = await start_service("validator", settings,
                              backends=own_bus.backends("validator", fresh_db_url))
    tracker_ctx = await start_service("tracker", settings,
                                      backends=own_bus.backends("tracker", fresh_db_url))
    agent_ctx = await start_service("agent", settings, need_db=False,
                                    backends=own_bus.backends(agent_user(AGENT)))
    analyzer = await own_bus.connect("analyzer")
    watcher = await own_bus.connect()  # the operator, to hear every incident event
    stop = asyncio.Event()
    validator = Validator(ctx, validator_config)
    stack = MiniStack(settings, ctx, validator, analyzer)

    async def on_event(msg: Any) -> None:
        stack.events.append(IncidentEvent.model_validate_json(msg.data))

    sub = await watcher.subscribe(Subjects.ALL_INCIDENTS, cb=on_event)
    tasks = [
        asyncio.create_task(run_agent(agent_ctx, stop, agent_id=AGENT,
                                      settings=AgentSettings(
                                          poll_s=0.02, counters_s=0.5,
                                          nvml_lib=str(native_build_dir() / "fake" /
                                                       "libnvidia-ml.so.1")))),
        asyncio.create_task(run_tracker(tracker_ctx, stop)),
        asyncio.create_task(run_validator(ctx, stop, validator=validator)),
    ]
    try:
        yield stack
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await sub.unsubscribe()
        for nc in (watcher, analyzer):
            await nc.close()
        await agent_ctx.close()
        await tracker_ctx.close()
        await ctx.close()
