"""The fault's end under a plan that hides it: the planner asks the validator again and reverts
once the GPU is found healthy; and a restarted planner goes on with the loss it had counted."""

from __future__ import annotations

import asyncio

from services.common.bus.client import publish
from services.common.bus.contract import IncidentEvent, Subjects, Suspicion
from services.common.bus.streams import EVENTS
from services.common.db import repository as repo
from services.common.db.documents import Evidence, Validation
from services.planner import rounds
from tests.services.common.support import stored
from tests.services.planner.conftest import Bench, Rig


async def _suspicions(rig: Rig) -> list[Suspicion]:
    return [Suspicion.model_validate_json(d)
            for d in await stored(await rig.js(), EVENTS, Subjects.suspicion(rig.job))]


async def _validate(rig: Rig, inc: str, s: Suspicion, verdict: str) -> None:
    """What the validator does with the planner's suspicion."""
    async with rig.ctx.db()() as session:
        row = await repo.get_incident_for_update(session, inc)
        assert row is not None
        detail = Validation(suspicion=s.event_id, verdict=verdict, gemm_s={"1": 1.0, "0": 1.0})
        row.evidence = row.evidence.merged(Evidence(validation=detail))
        await repo.add_timeline(session, row, "validated", detail)
        await session.commit()
    await publish(await rig.js("analyzer"), Subjects.incident(rig.job), IncidentEvent(
        job_id=rig.job, incident_id=inc, stage="validated", kind="compute_slow", severity=1.0,
        summary="test"))


async def test_a_recheck_that_finds_the_gpu_healthy_reverts_the_plan(bench: Bench) -> None:
    async with bench.planner(recheck_s=0.3) as rig:
        inc = await rig.s2_applied(1, cost_s=0.2)
        # First re-check: still slow. The incident stays mitigated, the plan in force.
        first = (await rig.wait(lambda: _suspicions(rig), "a re-check"))[0]
        assert first.ranks == [1] and first.kind == "compute_slow" and first.incident_id == inc
        await _validate(rig, inc, first, "compute_slow")
        await rig.wait(lambda: _count_suspicions(rig, 2), "a second re-check")
        assert (await rig.incident_row(inc)).status == "mitigated"
        assert await _plan_is(rig, "applied")
        # Second: healthy. The plan is reverted, the incident waits for the tracker's recovery.
        second = (await _suspicions(rig))[1]
        await _validate(rig, inc, second, "transient")
        await rig.wait(lambda: _plan_is(rig, "reverted"), "the revert")
        stages = await rig.stages(inc)
        assert stages[-3:] == ["validated", "validated", "plan_reverted"]
        assert (await rig.incident_row(inc)).status == "mitigated"
        assert inc not in rig.planner.tracked


async def test_a_restarted_planner_goes_on_with_the_loss_it_counted(bench: Bench) -> None:
    async with bench.planner(s2_overhead_s=4.0) as rig:
        await rig.layout(tp=1, dp=4, pp=1, gpus_per_node=4, microbatches=16)
        inc = await rig.incident(kind="compute_slow", before_s=1.0, after_s=2.0, gpus=[1])
        await rig.wait(lambda: _has(rig, inc), "the escalation to start")
        await rig.iterations(2.0, 3)  # 3 s of loss of 4
        await rig.wait(lambda: _loss(rig, inc, 3.0), "3 s of loss")
        await rig.planner.close()  # saves the state, as on shutdown
        job = rig.job
    async with bench.planner(s2_overhead_s=4.0) as again:
        again.job, again.iteration = job, rig.iteration  # the same job, a new planner process
        await again.wait(lambda: _has(again, inc), "the restored escalation")
        assert again.planner.tracked[inc].esc.loss_s == 3.0
        assert await again.plans() == []
        await again.iterations(2.0, 1)  # the 4th second of loss
        (plan,) = await again.wait(again.plans, "the S2 plan")
        assert plan.strategy == "S2" and plan.params.loss_s == 4.0


async def test_a_planner_killed_between_saves_counts_again_what_it_had_not_saved(
        bench: Bench) -> None:
    """Killed (no shutdown save), the planner's saved loss is its last periodic save: the
    restarted planner reads the job's iterations again from that save's last one, so neither
    the second counted after it nor the one sent while it was down is lost, and none counts
    twice."""
    async with bench.planner(s2_overhead_s=4.0) as rig:
        await rig.layout(tp=1, dp=4, pp=1, gpus_per_node=4, microbatches=16)
        inc = await rig.incident(kind="compute_slow", before_s=1.0, after_s=2.0, gpus=[1])
        await rig.wait(lambda: _has(rig, inc), "the escalation to start")
        await rig.iterations(2.0, 2)
        await rig.wait(lambda: _loss(rig, inc, 2.0), "2 s of loss")
        await rounds.save(rig.planner.state, now=True)  # the periodic save
        await rig.iterations(2.0, 1)
        await rig.wait(lambda: _loss(rig, inc, 3.0), "3 s of loss")
        for t in rig.planner.tracked.values():
            t.dirty = False  # as a kill leaves it: the shutdown saves nothing
        job = rig.job
    async with bench.planner(s2_overhead_s=4.0) as down:
        down.job, down.iteration = job, rig.iteration
        await down.iterations(2.0, 1)  # sent while no planner reads (this one has no watch)
    async with bench.planner(s2_overhead_s=4.0) as again:
        again.job, again.iteration = job, down.iteration
        await again.wait(lambda: _has(again, inc), "the restored escalation")
        (plan,) = await again.wait(again.plans, "the S2 plan")
        assert plan.strategy == "S2" and plan.params.loss_s == 4.0
        await asyncio.sleep(0.5)  # anything read twice would show by now (the loss goes on)
        esc = again.planner.tracked[inc].esc
        assert esc.loss_s == 4.0 and esc.slow_iterations == 4, (esc.loss_s, esc.slow_iterations)


async def _has(rig: Rig, inc: str) -> bool:
    return inc in rig.planner.tracked


async def _loss(rig: Rig, inc: str, loss: float) -> bool:
    t = rig.planner.tracked.get(inc)
    return t is not None and t.esc.loss_s >= loss


async def _plan_is(rig: Rig, status: str) -> bool:
    return any(p.status == status for p in await rig.plans())


async def _count_suspicions(rig: Rig, n: int) -> bool:
    await asyncio.sleep(0.1)
    return len(await _suspicions(rig)) >= n
