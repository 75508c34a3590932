"""Planners split by job under leases (issue 21): of two planners only the lease holder
escalates; when its lease is lost in the middle of an escalation it drops it unsaved, the
standby restores it from the last save, counts again what was not saved, and proposes the plan
once; with two partitions each planner restores its own jobs' escalations only."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg

from services.common.bus.client import publish
from services.common.bus.contract import IncidentEvent, Subjects
from services.common.db import repository as repo
from services.common.leases import dsn, namespace, owners
from services.common.ownership import Partition, partition_of
from services.common.runtime import start_service
from services.common.settings import Settings
from services.planner import rounds
from services.planner.service import Planner, run_planner
from services.planner.settings import PlannerSettings
from services.planner.state import PlannerState
from tests.conftest import Bus, new_bus
from tests.services.planner.conftest import FAST, Bench, Rig
from tests.services.planner.test_two_planners import S2, _nothing, _tracked, _validated

LEASE = {"lease_valid_s": 1.5, "lease_retry_s": 0.2, "s2_overhead_s": 4.0}


async def _cut_lease(db_url: str) -> None:
    """End the session holding the planner's lease, as a network partition or a dead host
    would (the planners here share one process: their sessions are told apart by the lock)."""
    conn = await asyncpg.connect(dsn(db_url))
    try:
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' "
            "AND objsubid = 2 AND granted AND classid::int8 = $1", namespace("planner"))
    finally:
        await conn.close()


async def test_the_standby_finishes_an_escalation_whose_owner_lost_its_lease_once(
        bench: Bench) -> None:
    async with bench.planner(**LEASE) as a, bench.planner(**LEASE) as b:
        async def held() -> bool:
            return 0 in await owners(bench.db_url, "planner")

        await a.wait(held, "a planner to hold the lease")
        await a.layout(tp=1, dp=4, pp=1, gpus_per_node=4, microbatches=16)
        inc = await a.incident(kind="compute_slow", before_s=1.0, after_s=2.0, gpus=[1])

        async def tracker_of() -> Rig | None:
            return next((r for r in (a, b) if inc in r.planner.tracked), None)

        owner: Rig = await a.wait(tracker_of, "the escalation to start")
        other = b if owner is a else a
        await a.iterations(2.0, 2)
        await a.wait(lambda: _loss(owner, inc, 2.0), "2 s of loss")
        await rounds.save(owner.planner.state, now=True)  # the owner's periodic save
        await a.iterations(2.0, 1)
        await a.wait(lambda: _loss(owner, inc, 3.0), "3 s of loss")
        # only the lease holder escalates and watches the job
        assert other.planner.tracked == {} and other.planner.state.watches.of == {}
        await _cut_lease(bench.db_url)

        async def dropped() -> bool:
            return not owner.planner.tracked and not owner.planner.state.watches.of

        await a.wait(dropped, "the owner to drop the escalation", timeout_s=10.0)
        await a.wait(lambda: _loss(other, inc, 3.0), "the standby to restore and count again",
                     timeout_s=15.0)
        assert await a.plans() == []  # 3 s of loss of 4: nothing proposed by either
        await a.iterations(2.0, 1)  # the 4th second of loss
        (plan,) = await a.wait(a.plans, "the S2 plan")
        await asyncio.sleep(1.0)  # a second proposal or delivery would show by now
        (plan,) = await a.plans()
        assert plan.strategy == "S2" and plan.params.loss_s == 4.0 and plan.version == 1
        assert [d.version for d in await a.deliveries()] == [1]
        stages = await a.stages(inc)
        assert stages.count("plan_proposed") == 1 and stages.count("plan_approved") == 1
        esc = other.planner.tracked[inc].esc
        assert esc.loss_s == 4.0 and esc.slow_iterations == 4, (esc.loss_s, esc.slow_iterations)
        assert owner.planner.tracked == {}  # the planner that lost it never took it back


async def _loss(rig: Rig, inc: str, loss: float) -> bool:
    t = rig.planner.tracked.get(inc)
    return t is not None and t.esc.loss_s >= loss


async def test_with_two_partitions_a_planner_restores_its_jobs_escalations_only(
        bus: Bus, fresh_db_url: str) -> None:
    async with bus.service("planner", fresh_db_url) as ctx:
        first = PlannerState.of(ctx, PlannerSettings(**FAST), _nothing)
        try:
            await _restore_split(first)
        finally:
            await first.watches.close()


async def _restore_split(first: PlannerState) -> None:
    jobs = [f"part-{i}-{uuid.uuid4().hex[:4]}" for i in range(8)]
    assert {partition_of(j, 2) for j in jobs} == {0, 1}
    incidents = {}
    for job in jobs:
        incidents[job] = await _validated(first.ctx, job)
        await _tracked(first, incidents[job])  # its escalation started and saved
    restored: dict[int, set[str]] = {}
    for index in (0, 1):
        st = PlannerState.of(first.ctx, PlannerSettings(**FAST), _nothing)
        st.part = Partition(index, 2)
        try:
            await rounds.restore(st)
            restored[index] = {t.job_id for t in st.tracked.values()}
            assert set(st.watches.of) == restored[index]
        finally:
            await st.watches.close()
    assert restored[0] | restored[1] == set(jobs) and not restored[0] & restored[1]
    assert restored[1] == {j for j in jobs if partition_of(j, 2) == 1}
    async with first.ctx.db()() as session:
        assert len(await repo.open_escalations(session)) >= len(jobs)


async def test_with_two_partitions_a_planner_expires_its_jobs_proposals_only(
        bus: Bus, fresh_db_url: str) -> None:
    """Proposals past their time, of jobs of both partitions: each planner's round expires its
    own partition's (the other's owner notes them on its incidents' timelines)."""
    async with bus.service("planner", fresh_db_url) as ctx:
        jobs = [f"exp-{i}-{uuid.uuid4().hex[:4]}" for i in range(8)]
        assert {partition_of(j, 2) for j in jobs} == {0, 1}
        plans = {}
        for job in jobs:
            incident = await _validated(ctx, job)
            async with ctx.db()() as session:
                plan = await repo.create_plan(
                    session, incident_id=incident, job_id=job, strategy="S2", params=S2,
                    policy="approval", expected_gain=1.5,
                    expires_at=datetime.now(UTC) - timedelta(seconds=1))
                await session.commit()
            assert plan is not None
            plans[job] = plan.id
        for index in (1, 0):
            st = PlannerState.of(ctx, PlannerSettings(**FAST), _nothing)
            st.part = Partition(index, 2)
            await rounds.expire(st)
            async with ctx.db()() as session:
                rows = await repo.plans_by_id(session, list(plans.values()))
            expired = {j for j, p in plans.items() if rows[p].status == "expired"}
            assert expired == {j for j in jobs if partition_of(j, 2) >= index}


def test_two_planners_on_two_partitions_split_the_jobs(fresh_db_url: str, tmp_path: Path) -> None:
    """Two planner services, two partitions, on a bus that grants each partition's durable by
    name: each holds one partition's lease and escalates that partition's validated incidents,
    none of the other's."""
    jobs = [f"two-{i}-{uuid.uuid4().hex[:4]}" for i in range(8)]
    assert {partition_of(j, 2) for j in jobs} == {0, 1}

    async def scenario(bus: Bus) -> None:
        settings = Settings(nats_url=bus.url, database_url=fresh_db_url, data_dir=tmp_path,
                            tracker_partitions=2)
        analyzer = await start_service("analyzer", settings,
                                       backends=bus.backends("analyzer", fresh_db_url))
        ctxs = [await start_service("planner", settings,
                                    backends=bus.backends("planner", fresh_db_url))
                for _ in range(2)]
        planners = [Planner(c, PlannerSettings(**{**FAST, **LEASE})) for c in ctxs]
        stop = asyncio.Event()
        tasks = [asyncio.create_task(run_planner(c, stop, planner=p))
                 for c, p in zip(ctxs, planners, strict=True)]
        try:
            end = time.monotonic() + 20.0
            while set(await owners(fresh_db_url, "planner")) != {0, 1}:
                assert time.monotonic() < end, "both partitions owned"
                await asyncio.sleep(0.05)
            incidents = {}
            for job in jobs:
                incidents[job] = await _validated(analyzer, job)
                await publish(analyzer.js, Subjects.incident(job), IncidentEvent(
                    job_id=job, incident_id=incidents[job], stage="validated",
                    kind="compute_slow", severity=2.0, summary="test"))
            end = time.monotonic() + 30.0
            while sum(len(p.tracked) for p in planners) < len(jobs):
                assert time.monotonic() < end, [len(p.tracked) for p in planners]
                await asyncio.sleep(0.05)
            for p in planners:
                part = p.state.part
                assert part.count == 2
                assert {t.job_id for t in p.tracked.values()} == {
                    j for j in jobs if partition_of(j, 2) == part.index}
            assert {p.state.part.index for p in planners} == {0, 1}
        finally:
            stop.set()
            await asyncio.gather(*tasks)
            for c in [*ctxs, analyzer]:
                await c.close()

    with new_bus("gh-pl-split-", tracker_partitions=2) as bus:
        asyncio.run(scenario(bus))
