"""A second fault while the first is open, through the analyzer on a real nats-server and
Postgres: stand-in agents publish a profile in which rank 2 is late, and from the second
profiling on rank 1 as well. The further slowdown opens its own incident naming rank 1 only;
a partial recovery resolves that one, a full recovery the first."""

from __future__ import annotations

import asyncio
import uuid
from functools import partial
from typing import Any

import numpy as np
from nats.aio.msg import Msg

from services.analyzer.profiling import CollectiveFeed
from services.analyzer.service import Analyzer
from services.analyzer.slow import SlowLocalizer
from services.common.bus.client import BusClient, publish
from services.common.bus.contract import (
    CollectiveBatch,
    ControlReply,
    ControlRequest,
    DetectionEvent,
    DetectionKind,
    Subjects,
)
from services.common.db import repository as repo
from services.common.db.documents import PlanStep, Validation
from services.common.db.models import Incident
from services.common.runtime import ServiceContext
from tests.services.analyzer.helpers import AGENTS, fed_localizer, register_ranks

COMM = (1 << 64) - 777


def collectives(job: str, agent: str, ranks: list[int], late: dict[int, float],
                seed: int) -> CollectiveBatch:
    """40 iterations of one all-reduce on a 4-rank communicator; `late` ranks (ms) enter late
    and everyone leaves together."""
    rng = np.random.default_rng(seed)
    cols: dict[str, list[int]] = {k: [] for k in CollectiveBatch.COLUMNS}
    t0 = 1_700_000_000_000_000_000
    for it in range(40):
        start = t0 + it * 80_000_000
        compute = {r: 30e6 + rng.normal(0, 0.2e6) + late.get(r, 0.0) * 1e6 for r in range(4)}
        exit_ns = start + int(max(compute.values()) + 0.5e6)
        for r in ranks:
            row = {"rank": r, "comm_id": COMM, "comm_rank": r, "nranks": 4, "seq": it + 1,
                   "op": 1, "count": 1 << 18, "dtype": 7, "peer": -1,
                   "enter_ns": start + int(compute[r]), "exit_ns": exit_ns,
                   "gpu_start_ns": 0, "gpu_end_ns": 0}
            for key, value in row.items():
                cols[key].append(value)
    return CollectiveBatch(job_id=job, agent_id=agent, **cols)


async def _agents(agents: dict[str, BusClient], job: str) -> dict[str, int]:
    """Stand-in agents, each on its own connection (so in no set order): an agent's n-th
    profile window is the job's n-th, drawn from the same seed by both. Returns how many
    profile requests each has served so far (it grows as they serve)."""
    served = dict.fromkeys(AGENTS, 0)
    for i, agent in enumerate(AGENTS):
        async def answer(msg: Msg, agent: str = agent, i: int = i) -> None:
            req = ControlRequest.model_validate_json(msg.data)
            await msg.respond(ControlReply(ok=True, agent_id=agent).model_dump_json().encode())
            if req.mode == "profile":
                served[agent] += 1
                late = {2: 25.0} if served[agent] <= 1 else {2: 25.0, 1: 40.0}
                await publish(agents[agent].jetstream(), Subjects.collectives(job, agent),
                              collectives(job, agent, [2 * i, 2 * i + 1], late,
                                          seed=served[agent]))
        await agents[agent].subscribe(Subjects.control(job, agent), cb=answer)
        await agents[agent].flush()  # subscribed before the analyzer asks
    return served


async def _started(ctx: ServiceContext, agents: dict[str, BusClient], job: str
                   ) -> tuple[Analyzer, SlowLocalizer, CollectiveFeed, asyncio.Task[None]]:
    """The job's ranks registered, its stand-in agents answering, an analyzer over a fed
    localizer: (analyzer, localizer, the feed, its task)."""
    await register_ranks(ctx, job)
    await _agents(agents, job)
    localizer, feed, feeding = fed_localizer(ctx, job)
    return Analyzer(ctx, localizer.work, localizer), localizer, feed, feeding


async def _incidents(ctx: ServiceContext, job: str) -> list[Incident]:
    """The job's incidents, oldest first."""
    async with ctx.db()() as session:
        rows = await repo.list_incidents(session, job_id=job)
    return sorted(rows, key=lambda r: r.opened_at)


async def _settled(analyzer: Analyzer) -> None:
    """Until the job's localisations, running and queued, are over."""
    assert analyzer.localizer is not None
    for _ in range(400):
        if not analyzer._chains and not analyzer.localizer.tasks:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("localisation did not finish")


def _det(job: str, kind: DetectionKind, change: str, first: int, before: float, after: float
         ) -> DetectionEvent:
    return DetectionEvent(job_id=job, kind=kind,
                          ranks=[0, 1, 2, 3], first_iteration=first,
                          detected_iteration=first + 4, before_s=before, after_s=after,
                          detected_ns=0, evidence={"change": change, "healthy_s": 0.031})


async def test_second_fault_is_its_own_incident_and_partial_recovery_ends_it(
        ctx: ServiceContext, agents: dict[str, BusClient]) -> None:
    job = f"second{uuid.uuid4().hex[:8]}"
    analyzer, localizer, feed, feeding = await _started(ctx, agents, job)
    settle = partial(_settled, analyzer)

    async def rows() -> list[dict[str, Any]]:
        return [{"id": r.id, "kind": r.kind, "status": r.status, "culprit": r.culprit.as_json(),
                 "opened": r.opened_at,
                 "timeline": [(e.stage, e.detail.as_json()) for e in r.timeline]}
                for r in await _incidents(ctx, job)]

    try:
        # Both detections arrive before the first localisation ends: the second waits for it.
        await analyzer.consume("", _det(job, "slowdown", "onset", 100, 0.031, 0.056))
        await analyzer.consume("", _det(job, "slowdown", "further", 300, 0.056, 0.071))
        await settle()
        first, second = await rows()
        assert first["kind"] == "compute_slow" and first["culprit"]["compute_ranks"] == [2]
        assert second["kind"] == "compute_slow" and second["culprit"]["compute_ranks"] == [1], \
            second
        assert second["timeline"][0][1]["change"] == "further"
        assert [d.get("further") for _, d in first["timeline"]].count(second["id"]) == 1
        # The second cause ends: back near the first level. Then the first one ends.
        await analyzer.consume("", _det(job, "recovery", "partial", 500, 0.071, 0.057))
        first, second = await rows()
        assert (first["status"], second["status"]) != ("resolved", "resolved")
        assert second["status"] == "resolved" and first["status"] != "resolved"
        await analyzer.consume("", _det(job, "recovery", "full", 700, 0.057, 0.031))
        assert [r["status"] for r in await rows()] == ["resolved", "resolved"]
    finally:
        feed.stop()
        await feeding
        await analyzer.stop()
        await localizer.stop()


async def test_a_further_slowdown_with_nothing_new_closes_as_the_known_cause(
        ctx: ServiceContext, agents: dict[str, BusClient]) -> None:
    """Rank 2 just gets later: the new incident finds only the known culprit and closes."""
    job = f"worse{uuid.uuid4().hex[:8]}"
    await register_ranks(ctx, job)
    for i, agent in enumerate(AGENTS):
        async def answer(msg: Msg, agent: str = agent, i: int = i) -> None:
            req = ControlRequest.model_validate_json(msg.data)
            await msg.respond(ControlReply(ok=True, agent_id=agent).model_dump_json().encode())
            if req.mode == "profile":
                await publish(agents[agent].jetstream(), Subjects.collectives(job, agent),
                              collectives(job, agent, [2 * i, 2 * i + 1], {2: 35.0}, seed=3))
        await agents[agent].subscribe(Subjects.control(job, agent), cb=answer)
        await agents[agent].flush()  # subscribed before the analyzer asks
    localizer, feed, feeding = fed_localizer(ctx, job)
    analyzer = Analyzer(ctx, localizer.work, localizer)
    try:
        await analyzer.consume("", _det(job, "slowdown", "onset", 100, 0.031, 0.056))
        await analyzer.consume("", _det(job, "slowdown", "further", 300, 0.056, 0.066))
        for _ in range(400):
            if not analyzer._chains and not localizer.tasks:
                break
            await asyncio.sleep(0.05)
        async with ctx.db()() as session:
            found = sorted(await repo.list_incidents(session, job_id=job),
                           key=lambda r: r.opened_at)
        assert [(r.kind, r.status) for r in found] == [("compute_slow", "localized"),
                                                        ("slowdown", "resolved")]
        assert found[1].timeline[-1].detail.as_json()["result"] == "known cause"
    finally:
        feed.stop()
        await feeding
        await analyzer.stop()
        await localizer.stop()


async def _mitigated(ctx: ServiceContext, incident_id: str) -> None:
    """The incident validated and a plan applied to it, as the validator and planner record."""
    async with ctx.db()() as session:
        inc = await repo.get_incident_for_update(session, incident_id)
        assert inc is not None
        await repo.add_timeline(session, inc, "validated",
                                Validation(suspicion=uuid.uuid4().hex, verdict="compute_slow"))
        await repo.add_timeline(session, inc, "mitigated",
                                PlanStep(plan_id="p", strategy="S3", version=1, cost_s=30.0,
                                         summary="test"))
        await session.commit()


async def test_a_plans_recovery_that_leaves_the_job_slow_is_localised_again(
        ctx: ServiceContext, agents: dict[str, BusClient]) -> None:
    """Rank 1 slowed while rank 2's plan was being applied: the tracker saw one step down (the
    plan's) and no step up. What the plan left above 1.3x healthy is a further slowdown, named
    for what the open incident does not name; a plan's shortfall under that is not."""
    job = f"rest{uuid.uuid4().hex[:8]}"
    analyzer, localizer, feed, feeding = await _started(ctx, agents, job)
    settle = partial(_settled, analyzer)

    async def found() -> list[tuple[str, str, list[int], dict[str, Any]]]:
        return [(r.kind, r.status, r.culprit.as_json().get("compute_ranks", []),
                 r.timeline[0].detail.as_json()) for r in await _incidents(ctx, job)]

    try:
        await analyzer.consume("", _det(job, "slowdown", "onset", 100, 0.031, 0.071))
        await settle()
        ((kind, status, ranks, _),) = await found()
        assert (kind, status, ranks) == ("compute_slow", "localized", [2])
        # Partial recoveries before any plan, or under one that leaves <= 1.3x, are noted.
        await analyzer.consume("", _det(job, "recovery", "partial", 200, 0.071, 0.065))
        assert len(await found()) == 1
        first_id = (await _incidents(ctx, job))[0].id
        await _mitigated(ctx, first_id)
        await analyzer.consume("", _det(job, "recovery", "partial", 250, 0.065, 0.038))
        await settle()
        assert len(await found()) == 1
        # Under the plan the job stays at 0.056 s, 1.8x its healthy 0.031 s: localised again.
        await analyzer.consume("", _det(job, "recovery", "partial", 300, 0.071, 0.056))
        await settle()
        first, second = await found()
        assert first[:2] == ("compute_slow", "mitigated")
        assert second[:3] == ("compute_slow", "localized", [1]), second
        opened_from = second[3]  # a further slowdown from the healthy level to what is left
        assert (opened_from["change"], opened_from["before_s"], opened_from["after_s"]) == (
            "further", 0.031, 0.056)
    finally:
        feed.stop()
        await feeding
        await analyzer.stop()
        await localizer.stop()
