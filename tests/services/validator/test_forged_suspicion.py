"""Forged and replayed suspicions through the real validator consumer: each one is refused and
dead-lettered with its reason, and no agent is asked anything (so no rank can park); a
suspicion of what the analyzer localised still reaches the agents."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from nats.aio.msg import Msg

from services.common.bus.auth import agent_user
from services.common.bus.client import BusClient, publish
from services.common.bus.contract import ControlReply, ControlRequest, Subjects, Suspicion
from services.common.bus.permissions import bind_agent
from services.common.bus.streams import EVENTS
from services.common.db import repository as repo
from services.common.db.documents import Culprit, Empty, Evidence
from services.common.runtime import ServiceContext, start_service
from services.common.settings import Settings
from services.validator.service import Validator, run_validator
from services.validator.settings import ValidatorSettings
from tests.conftest import Bus
from tests.services.common.support import letters_for, until

AGENT = "standin"
WORLD = 4
COMM = 77


@dataclass
class StandIn:
    """Records every control request; refuses them all, so a validation that gets this far
    fails without pausing (what matters is whether it got this far)."""

    asked: list[ControlRequest] = field(default_factory=list)

    async def answer(self, msg: Msg) -> None:
        self.asked.append(ControlRequest.model_validate_json(msg.data))
        reply = ControlReply(ok=False, error="stand-in", agent_id=AGENT)
        await msg.respond(reply.model_dump_json().encode())


@dataclass
class Running:
    ctx: ServiceContext
    validator: Validator
    agent: StandIn
    job: str
    forger: BusClient  # holds the analyzer's bus password: it may publish suspicions
    operator: BusClient  # reads the dead letters


@pytest.fixture()
async def running(own_bus: Bus, fresh_db_url: str, tmp_path: Path) -> AsyncIterator[Running]:
    settings = Settings(nats_url=own_bus.url, database_url=fresh_db_url, data_dir=tmp_path)
    ctx = await start_service("validator", settings,
                              backends=own_bus.backends("validator", fresh_db_url))
    job = f"forged{uuid.uuid4().hex[:8]}"
    async with ctx.db()() as session:
        await repo.touch_job(session, job, world_size=WORLD)
        await repo.upsert_ranks(session, job, AGENT, [
            {"rank": r, "host": "node0", "node": 0, "device": r, "pid": 100 + r}
            for r in range(WORLD)])
        await session.commit()
    agent = StandIn()
    agent_nc = await own_bus.connect(agent_user(AGENT))
    subs = [await agent_nc.subscribe(bind_agent(s, AGENT), cb=agent.answer)
            for s in (Subjects.ALL_CONTROL, Subjects.ALL_VALIDATION)]
    await agent_nc.flush()  # subscribed before the validator asks, on another connection
    forger, operator = await own_bus.connect("analyzer"), await own_bus.connect()
    validator = Validator(ctx, ValidatorSettings(status_timeout_s=2.0))
    stop = asyncio.Event()
    task = asyncio.create_task(run_validator(ctx, stop, validator=validator))
    try:
        yield Running(ctx, validator, agent, job, forger, operator)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        for sub in subs:
            await sub.unsubscribe()
        for nc in (agent_nc, forger, operator):
            await nc.close()
        await ctx.close()


async def _incident(r: Running, *, stage: str | None, culprit: Culprit,
                    job: str | None = None) -> str:
    async with r.ctx.db()() as session:
        inc = await repo.open_incident(
            session, job_id=job or r.job, kind="slowdown", dedup_key=f"slow-{uuid.uuid4().hex}",
            severity=1.5, summary="test", culprit=culprit, evidence=Evidence(),
            stage_detail=Empty())
        if stage is not None:
            await repo.add_timeline(session, inc, stage, Empty())
        await session.commit()
        return inc.id


async def test_forged_suspicions_are_dead_lettered_and_ask_no_agent(running: Running) -> None:
    r = running
    named = Culprit(compute_ranks=[1], comm_ids=[COMM])
    localized = await _incident(r, stage="localized", culprit=named)
    resolved = await _incident(r, stage="resolved", culprit=named)
    detected = await _incident(r, stage=None, culprit=named)
    other_job = f"other{uuid.uuid4().hex[:6]}"
    async with r.ctx.db()() as session:
        await repo.touch_job(session, other_job)
        await session.commit()
    elsewhere = await _incident(r, stage="localized", culprit=named, job=other_job)

    def s(incident: str, **kw: Any) -> Suspicion:
        fields: dict[str, Any] = {"job_id": r.job, "incident_id": incident, "kind": "mixed_slow",
                                  "ranks": [1], "comm_ids": [COMM]}
        fields.update(kw)
        return Suspicion(**fields)

    forged = {
        "no incident": s("0" * 32),
        "is resolved": s(resolved),
        "not localised": s(detected),
        f"is job {other_job}'s": s(elsewhere),
        "every GPU": s(localized, ranks=[], comm_ids=[]),
        "not ranks of": s(localized, ranks=list(range(WORLD + 1))),
        "were not localised": s(localized, ranks=[3]),
    }
    for msg in forged.values():
        await publish(r.forger.jetstream(), Subjects.suspicion(r.job), msg)
    subject = Subjects.suspicion(r.job)
    found: list[str] = []

    async def letters() -> int:
        found[:] = [x.reason for x in await letters_for(r.operator.jetstream(), EVENTS, subject)]
        return len(found)

    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while await letters() < len(forged) and loop.time() < deadline:
        await asyncio.sleep(0.2)
    assert len(found) == len(forged), found
    for reason in forged:
        assert sum(reason in f and "SuspicionRefused" in f for f in found) >= 1, (reason, found)
    assert r.validator.refused == len(forged)
    assert r.agent.asked == [] and not r.validator.runs  # nobody was asked to do anything

    # The same check lets a suspicion of what was localised through: it reaches the agent.
    await publish(r.forger.jetstream(), subject, s(localized))
    await until(lambda: len(r.validator.runs) == 1, timeout_s=60, what="the real validation")
    assert r.agent.asked and r.agent.asked[0].action == "status"
    assert r.validator.runs[0].failure is not None  # the stand-in refused: nothing paused
