"""A suspected slowdown through the analyzer on a real nats-server and Postgres: it is profiled
and localised, but its validation (a pause) waits for the tracker's confirmation; a withdrawn
one is resolved, never validated, and a slowdown suspected while its profiling still runs is
localised after it rather than dropped."""

from __future__ import annotations

import asyncio
import time
import uuid

import nats.errors

from services.analyzer.service import Analyzer
from services.common.bus.client import BusClient
from services.common.bus.contract import DetectionEvent, Subjects, Suspicion
from services.common.bus.streams import EVENTS
from services.common.db import repository as repo
from services.common.db.documents import Detection
from services.common.db.models import Incident
from services.common.runtime import ServiceContext
from tests.services.analyzer.helpers import fed_analyzer, register_ranks
from tests.services.analyzer.test_second_fault import _agents


def _slowdown(job: str, stage: str, first: int, detected: int, suspected: int,
              suspected_ns: int, confirms: str | None = None) -> DetectionEvent:
    return DetectionEvent(job_id=job, kind="slowdown", ranks=[0, 1, 2, 3],
                          first_iteration=first, detected_iteration=detected, before_s=0.031,
                          after_s=0.056, detected_ns=time.time_ns(),
                          evidence={"change": "onset", "healthy_s": 0.031},
                          stage="suspected" if stage == "suspected" else "confirmed",
                          suspected_iteration=suspected, suspected_ns=suspected_ns,
                          confirms=confirms)


def _withdrawn(job: str, first: int, suspicion: str) -> DetectionEvent:
    return DetectionEvent(job_id=job, kind="recovery", ranks=[0, 1, 2, 3], first_iteration=first,
                          detected_iteration=first + 7, before_s=0.056, after_s=0.031,
                          detected_ns=time.time_ns(),
                          evidence={"change": "withdrawn", "healthy_s": 0.031},
                          confirms=suspicion)


async def _suspicions(operator: BusClient, job: str) -> list[Suspicion]:
    sub = await operator.jetstream().pull_subscribe(Subjects.suspicion(job), durable=None,
                                                    stream=EVENTS)
    try:
        msgs = await sub.fetch(5, timeout=1.0)
    except (nats.errors.TimeoutError, TimeoutError):  # none: nats.py raises either
        msgs = []
    await sub.unsubscribe()
    return [Suspicion.model_validate_json(m.data) for m in msgs]


async def _incidents(ctx: ServiceContext, job: str) -> list[Incident]:
    async with ctx.db()() as session:
        return sorted(await repo.list_incidents(session, job_id=job), key=lambda i: i.opened_at)


async def _settle(analyzer: Analyzer) -> None:
    localizer = analyzer.localizer
    assert localizer is not None
    for _ in range(400):
        if not analyzer._chains and not localizer.tasks:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("localisation did not finish")


async def test_a_suspected_slowdown_is_localised_but_validated_only_once_confirmed(
        ctx: ServiceContext, agents: dict[str, BusClient], operator: BusClient) -> None:
    job = f"susp{uuid.uuid4().hex[:8]}"
    await register_ranks(ctx, job)
    await _agents(agents, job)
    suspected_ns = time.time_ns()
    async with fed_analyzer(ctx, job) as analyzer:
        seen = _slowdown(job, "suspected", 100, 103, 103, suspected_ns)
        await analyzer.consume("", seen)
        await _settle(analyzer)
        (inc,) = await _incidents(ctx, job)
        assert inc.status == "localized" and inc.culprit.compute_ranks == [2]
        assert inc.suspected_at is not None and inc.confirmed_at is None
        assert inc.suspected_iteration == 103 and inc.only_suspected
        assert inc.evidence.held_suspicion is not None
        assert await _suspicions(operator, job) == []  # no pause while only suspected
        await analyzer.consume("", _slowdown(job, "confirmed", 100, 104, 103, suspected_ns,
                                            confirms=seen.event_id))
        (inc,) = await _incidents(ctx, job)
        assert inc.confirmed_at is not None and inc.confirmed_iteration == 104
        assert inc.suspected_at is not None
        assert abs(inc.suspected_at.timestamp() - suspected_ns / 1e9) < 1e-3
        assert inc.suspected_at <= inc.confirmed_at and inc.evidence.held_suspicion is None
        (sent,) = await _suspicions(operator, job)
        assert sent.incident_id == inc.id and sent.ranks == [2]
        assert [e.detail.stage for e in inc.timeline if e.stage == "detected"
                and isinstance(e.detail, Detection)] == ["suspected", "confirmed"]


async def test_a_withdrawn_suspicion_is_resolved_never_validated_and_the_next_one_is_localised(
        ctx: ServiceContext, agents: dict[str, BusClient], operator: BusClient) -> None:
    """Withdrawn while it is being profiled: its profiling stops, its incident is resolved as
    withdrawn; a slowdown suspected right after waits for that profiling to end and is
    localised (it used to be dropped as a repeat of the running one)."""
    job = f"wdrw{uuid.uuid4().hex[:8]}"
    await register_ranks(ctx, job)
    served = await _agents(agents, job)
    async with fed_analyzer(ctx, job) as analyzer:
        seen = _slowdown(job, "suspected", 100, 103, 103, time.time_ns())
        await analyzer.consume("", seen)
        # withdrawn once its profiling has begun (every agent asked), so that the next
        # suspicion's profile is every agent's second, whatever the machine's pace
        for _ in range(400):
            if all(served.values()):
                break
            await asyncio.sleep(0.01)
        assert all(served.values()), served
        await analyzer.consume("", _withdrawn(job, 100, seen.event_id))
        await analyzer.consume("", _slowdown(job, "suspected", 300, 303, 303, time.time_ns()))
        await _settle(analyzer)
        first, second = await _incidents(ctx, job)
        assert first.status == "resolved" and first.confirmed_at is None
        assert [e.detail.result for e in first.timeline if e.stage == "resolved"
                and isinstance(e.detail, Detection)] == ["withdrawn"]
        # the stand-ins make rank 1 late too from their second profile on
        assert second.status == "localized" and second.culprit.compute_ranks == [1, 2]
        assert await _suspicions(operator, job) == []
