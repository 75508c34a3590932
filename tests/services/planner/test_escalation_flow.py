"""The planner on real NATS and Postgres, fed by hand: a compute fail-slow reaches S2 once its
loss pays for it, is delivered at once (automatic), applied, learned from and reverted when the
job recovers; a congested link waits for an operator's approval; what cannot be decided in time
expires and the ladder moves on; a job that cannot apply a plan gets its old layout back."""

from __future__ import annotations

import asyncio

import pytest

from greyhound.core.microbatch import allocate_microbatches
from services.common.db import repository as repo
from services.common.db.models import Plan, WebhookDelivery
from services.planner.settings import PlannerSettings
from tests.services.planner.conftest import Bench, Rig


async def _events(rig: Rig) -> list[str]:
    from sqlalchemy import select

    async with rig.ctx.db()() as session:
        rows = (await session.scalars(select(WebhookDelivery.event)
                                      .order_by(WebhookDelivery.id))).all()
    return list(rows)


async def _deciders(rig: Rig) -> list[str | None]:
    """Each plan event's ``decided_by``, in order."""
    from sqlalchemy import select

    async with rig.ctx.db()() as session:
        rows = (await session.scalars(select(WebhookDelivery).order_by(WebhookDelivery.id))).all()
    return [d.payload["plan"]["decided_by"] for d in rows if d.payload.get("plan")]


async def test_compute_s2_automatic_applied_learned_and_reverted(bench: Bench) -> None:
    async with bench.planner() as rig:
        await rig.webhook()
        await rig.layout(tp=1, dp=4, pp=1, gpus_per_node=4, microbatches=16)
        await rig.iterations(1.0, 5)  # healthy
        inc = await rig.incident(kind="compute_slow", before_s=1.0, after_s=1.5, gpus=[1],
                                 gemm={0: 1.0, 1: 2.0, 2: 1.0, 3: 1.0})
        await rig.wait(lambda: _tracked(rig, inc), "the escalation to start")
        # 1.5 s iterations lose 0.5 s each: S2's 3 s overhead is paid by the 6th, not before.
        await rig.iterations(1.5, 5)
        await rig.iterations(1.0, 3)
        await rig.wait(lambda: _fed(rig, inc, 13), "13 iterations")
        assert await rig.plans() == []  # 2.5 s of loss so far: not yet
        await rig.iterations(1.5, 1)
        plans = await rig.wait(rig.plans, "an S2 plan")
        (plan,) = plans
        # The GEMM timed GPU 1 at 2x its peers: DP group 1 runs 2 s per micro-batch.
        want = allocate_microbatches([1.0, 2.0, 1.0, 1.0], 16).counts
        assert plan.strategy == "S2" and plan.policy == "automatic"
        assert plan.status == "approved" and plan.version == 1
        assert plan.params.microbatches == list(want) and (plan.params.loss_s or 0) >= 3.0
        assert plan.expected_gain is not None and plan.expected_gain > 1.2
        msg = await rig.last_plan_message()
        assert (msg.version, msg.action, msg.microbatches) == (1, "apply", list(want))
        assert await rig.stages(inc) == ["detected", "localized", "validated", "plan_proposed",
                                         "plan_approved"]
        # The job applied it at a cost of 1 s: applied, incident mitigated, overhead learned.
        await rig.report(1, cost_s=1.0)
        await rig.wait(lambda: _status(rig, "applied"), "the plan applied")
        row = await rig.incident_row(inc)
        assert row.status == "mitigated" and (await rig.plans())[0].cost_s == 1.0
        assert rig.planner.tracked[inc].esc.overheads[_s2()] == 2.0  # 3 + 0.5 (1 - 3)
        # The tracker's recovery comes much later than the plan: the fault has ended.
        await rig.iterations(1.1, 30)
        await rig.wait(lambda: _fed(rig, inc, 44), "the iterations under the plan")
        await rig.recovery(before_s=1.1, after_s=1.0)
        await rig.resolve(inc)
        await rig.wait(lambda: _status(rig, "reverted"), "the revert")
        deliveries = await rig.deliveries()
        assert [(d.version, d.action) for d in deliveries] == [(1, "apply"), (2, "revert")]
        assert deliveries[1].message.microbatches is None  # back to the even split
        assert (await rig.last_plan_message(min_version=2)).version == 2
        assert await rig.stages(inc) == ["detected", "localized", "validated", "plan_proposed",
                                         "plan_approved", "mitigated", "resolved",
                                         "plan_reverted"]
        await rig.wait(lambda: _has_events(rig, 4), "webhook events")
        assert await _events(rig) == ["plan.proposed", "plan.approved", "plan.applied",
                                      "plan.reverted"]
        # who decided it goes with every event after the decision
        assert await _deciders(rig) == [None, "policy", "policy", "policy"]
        # A second incident of the job starts from what the job taught: 2 s, not 3 s.
        async with rig.ctx.db()() as session:
            assert await repo.learned_costs(session, rig.job) == [("S2", 1.0)]


async def test_link_waits_for_approval_then_recovers_under_its_plan(bench: Bench) -> None:
    async with bench.planner(hold_max_s=1.0) as rig:
        # TP1 DP2 PP2, one GPU per node: the DP ring of stage 0 crosses nodes 0-1.
        await rig.layout(tp=1, dp=2, pp=2, gpus_per_node=1, microbatches=8,
                         dp_allreduce_bytes=4e9, pp_activation_bytes=1e7)
        inc = await rig.incident(kind="comm_slow", before_s=1.0, after_s=2.0, links=[(0, 1)])
        await rig.wait(lambda: _tracked(rig, inc), "the escalation to start")
        assert rig.planner.tracked[inc].esc.ladder[1].name == "TOPOLOGY"  # no S2 for a link
        await rig.iterations(2.0, 5)  # 5 s of loss: S3's overhead
        (plan,) = await rig.wait(rig.plans, "an S3 proposal")
        assert plan.strategy == "S3" and plan.policy == "approval" and plan.status == "proposed"
        assert plan.params.kind == "role_swap" and plan.params.links == [[0, 1]]
        assert plan.expires_at is not None and plan.version is None
        assert await rig.deliveries() == []  # nothing reaches the job before a decision
        async with rig.ctx.db()() as session:
            row = (await repo.plans_by_id(session, [plan.id], for_update=True))[plan.id]
            await repo.decide_plan(session, row, decision="approve", approver="alice", comment="")
            await session.commit()
        (d,) = await rig.wait(rig.deliveries, "the approved plan's delivery")
        assert d.version == 1 and d.message.gpu_of_rank == plan.params.gpu_of_rank
        assert [tuple(p) for p in d.message.swaps] == [tuple(p) for p in plan.params.swaps]
        await rig.report(1, cost_s=2.0)
        await rig.wait(lambda: _status(rig, "applied"), "the plan applied")
        # The job is back to normal a few iterations later: that is the plan's doing.
        await rig.iterations(1.02, 3)
        await rig.recovery(before_s=2.0, after_s=1.02)
        await rig.resolve(inc)
        await rig.wait(lambda: _resolved_under_plan(rig, inc), "the incident to close under its plan")
        assert (await rig.plans())[0].status == "applied"
        # Nothing can re-check a link: after hold_max_s the plan is taken back anyway.
        await rig.wait(lambda: _status(rig, "reverted"), "the revert after hold_max_s")
        deliveries = await rig.deliveries()
        assert deliveries[-1].action == "revert" and deliveries[-1].message.gpu_of_rank is None


async def test_an_undecided_proposal_expires_and_the_ladder_moves_on(bench: Bench) -> None:
    async with bench.planner(proposal_ttl_s=0.5, s4_overhead_s=8.0) as rig:
        await rig.layout(tp=1, dp=2, pp=2, gpus_per_node=1, microbatches=8)
        inc = await rig.incident(kind="comm_slow", before_s=1.0, after_s=2.0, links=[(0, 1)])
        await rig.wait(lambda: _tracked(rig, inc), "the escalation to start")
        await rig.iterations(2.0, 5)
        await rig.wait(lambda: _status(rig, "expired"), "the proposal to expire")
        assert "plan_expired" in await rig.stages(inc)
        await rig.wait(lambda: _pending_none(rig, inc), "the ladder to move past S3")
        await rig.iterations(2.0, 4)  # 9 s of loss: S4's 8 s
        plans = await rig.wait(lambda: _count(rig, 2), "an S4 recommendation")
        s4 = plans[1]
        assert s4.strategy == "S4" and s4.status == "proposed" and s4.policy == "approval"
        assert s4.params.replace_nodes == [0] and s4.params.links == [[0, 1]]


async def test_a_plan_the_job_cannot_apply_fails_and_the_old_layout_is_delivered(
        bench: Bench) -> None:
    async with bench.planner() as rig:
        await rig.layout(tp=1, dp=4, pp=1, gpus_per_node=4, microbatches=16)
        inc = await rig.incident(kind="compute_slow", before_s=1.0, after_s=2.0, gpus=[2])
        await rig.wait(lambda: _tracked(rig, inc), "the escalation to start")
        await rig.iterations(2.0, 3)
        await rig.wait(rig.deliveries, "the S2 delivery")
        await rig.report(1, outcome="failed", error="sampler cannot split unevenly")
        await rig.wait(lambda: _status(rig, "failed"), "the plan failed")
        deliveries = await rig.deliveries()
        assert [(d.version, d.action, d.message.microbatches) for d in deliveries][1] == (
            2, "revert", None)
        assert "plan_failed" in await rig.stages(inc)
        assert (await rig.plans())[0].reason == "sampler cannot split unevenly"
        assert rig.planner.tracked[inc].esc.pending is None


async def test_the_escalation_of_a_job_gone_silent_ends_and_its_plan_is_taken_back(
        bench: Bench) -> None:
    """A job that stopped in the middle of an incident (finished, or died) no longer holds its
    escalation open, re-checked forever by every planner restored from the database."""
    async with bench.planner(job_silent_s=SILENT_S) as rig:
        inc = await rig.s2_applied(2, cost_s=1.0)
        # While the job talks (a batch a second, a fifth of the silence allowed), nothing ends.
        for _ in range(2 * int(SILENT_S)):
            await rig.iterations(1.1, 2)
            await asyncio.sleep(1.0)
        assert [p.status for p in await rig.plans()] == ["applied"]
        assert inc in rig.planner.tracked
        # Then it says nothing more.
        await rig.wait(lambda: _status(rig, "reverted"), "the revert of a silent job's plan")
        assert inc not in rig.planner.tracked
        (plan,) = await rig.plans()
        assert plan.reason is not None and "sent no iteration" in plan.reason, plan.reason
        assert "plan_reverted" in await rig.stages(inc)


SILENT_S = 5.0


def _s2() -> object:
    from greyhound.core.escalation import Strategy

    return Strategy.MICROBATCH


async def test_a_second_incident_pays_only_for_its_own_slow_iterations(bench: Bench) -> None:
    """The job's watch outlives its first incident, holding that incident's slow iterations;
    the next incident's loss starts at its own onset, so those do not buy its S3 at once."""
    async with bench.planner() as rig:
        await rig.layout(tp=1, dp=2, pp=2, gpus_per_node=1, microbatches=8,
                         dp_allreduce_bytes=4e9, pp_activation_bytes=1e7)
        first = await rig.incident(kind="compute_slow", before_s=1.0, after_s=3.0, gpus=[1])
        await rig.wait(lambda: _tracked(rig, first), "the first escalation")
        await rig.iterations(3.0, 10)  # 20 s of loss: four times S3's 5 s
        await rig.wait(lambda: _fed(rig, first, 10), "the first incident's iterations")
        # The second fault: detected 2 iterations after it began, 0.2 s each, so it began 1 s
        # (its floor) before it opened; the first incident's iterations are older than that.
        await asyncio.sleep(1.5)
        second = await rig.incident(kind="comm_slow", before_s=0.1, after_s=0.2,
                                    links=[(0, 1)])
        await rig.wait(lambda: _tracked(rig, second), "the second escalation")
        t = rig.planner.tracked[second]
        assert t.fed == 10 and t.esc.loss_s == 0.0  # nothing it did not see
        await rig.iterations(0.2, 4)
        await rig.wait(lambda: _fed(rig, second, 14), "the second incident's iterations")
        assert t.esc.loss_s == pytest.approx(0.4) and t.esc.slow_iterations == 4
        assert [p.strategy for p in await rig.plans() if p.incident_id == second] == []


@pytest.mark.parametrize("another_fault", [True, False])
async def test_a_later_recovery_under_a_link_plan_is_the_links_end_unless_another_fault_ended(
        bench: Bench, another_fault: bool) -> None:
    """The plan's recovery leaves the job at 2 s (1 s healthy). A later recovery from there is
    the link's end, and the plan goes, unless a fault found since rose to that level: the paper
    demo's GPU that slowed during the second S3's pause, whose end took that S3 back 45 s
    before its congestion ended."""
    async with bench.planner(settle_iterations=3) as rig:
        await rig.layout(tp=1, dp=2, pp=2, gpus_per_node=1, microbatches=8,
                         dp_allreduce_bytes=4e9, pp_activation_bytes=1e7)
        inc = await rig.incident(kind="comm_slow", before_s=1.0, after_s=3.0, links=[(0, 1)])
        await rig.wait(lambda: _tracked(rig, inc), "the escalation to start")
        await rig.iterations(3.0, 3)  # 6 s of loss: S3's 5 s
        (plan,) = await rig.wait(rig.plans, "an S3 proposal")
        async with rig.ctx.db()() as session:
            row = (await repo.plans_by_id(session, [plan.id], for_update=True))[plan.id]
            await repo.decide_plan(session, row, decision="approve", approver="alice", comment="")
            await session.commit()
        await rig.wait(rig.deliveries, "the approved plan's delivery")
        await rig.report(1, cost_s=2.0)
        await rig.wait(lambda: _status(rig, "applied"), "the plan applied")
        t = rig.planner.tracked[inc]
        await rig.iterations(2.0, 2)
        await rig.recovery(before_s=3.0, after_s=2.0)
        await rig.wait(lambda: _judged(rig, inc, True), "the plan's recovery")
        if another_fault:  # what the plan left, localised: a GPU at 2 s
            await rig.incident(kind="compute_slow", before_s=1.0, after_s=2.0, gpus=[0])
        await rig.iterations(2.0, 6)  # past settle_iterations
        await rig.wait(lambda: _fed(rig, inc, 11), "the iterations under the plan")
        await rig.iterations(1.0, 3)
        await rig.recovery(before_s=2.0, after_s=1.0)
        await rig.resolve(inc)
        if another_fault:
            await rig.wait(lambda: _resolved_under_plan(rig, inc), "closed under its plan")
            assert t.recovered_under_plan
            assert _s3(await rig.plans()).status == "applied"  # kept (hold_max_s 0)
        else:
            await rig.wait(lambda: _s3_is(rig, "reverted"), "the link's plan taken back")


def _s3(plans: list[Plan]) -> Plan:
    (s3,) = [p for p in plans if p.strategy == "S3"]
    return s3


async def _s3_is(rig: Rig, status: str) -> bool:
    return _s3(await rig.plans()).status == status


async def _judged(rig: Rig, inc: str, under_plan: bool) -> bool:
    t = rig.planner.tracked.get(inc)
    return t is not None and t.recovered_under_plan is under_plan


async def _tracked(rig: Rig, inc: str) -> bool:
    return inc in rig.planner.tracked


async def _fed(rig: Rig, inc: str, n: int) -> bool:
    t = rig.planner.tracked.get(inc)
    return t is not None and t.fed >= n


async def _pending_none(rig: Rig, inc: str) -> bool:
    t = rig.planner.tracked.get(inc)
    return t is not None and t.pending_plan is None


async def _resolved_under_plan(rig: Rig, inc: str) -> bool:
    t = rig.planner.tracked.get(inc)
    return t is not None and t.resolved


async def _status(rig: Rig, status: str) -> bool:
    return any(p.status == status for p in await rig.plans())


async def _count(rig: Rig, n: int) -> list[object] | None:
    plans = await rig.plans()
    return plans if len(plans) >= n else None  # type: ignore[return-value]


async def _has_events(rig: Rig, n: int) -> bool:
    return len(await _events(rig)) >= n


@pytest.mark.parametrize(("expected_s", "iterations", "words"), [
    (1440.0, 3, "0.5 x TOPOLOGY's overhead 5.0 s (a communication fail-slow is expected to last "
                "1440 s, past the break-even)"),
    (4.0, 10, "TOPOLOGY's overhead 5.0 s / 0.5 (a communication fail-slow is expected to end "
              "before the break-even)"),
])
async def test_the_expected_duration_moves_s3_by_the_default_trust(
        bench: Bench, expected_s: float, iterations: int, words: str) -> None:
    """A congestion losing half of every 2 s iteration pays S3's 5 s in 10 s. Expected to last
    24 minutes (the default), S3 is proposed once 0.5 x 5 s are lost, at the third slow
    iteration; expected to last 4 s, not before 5 s / 0.5, at the tenth."""
    trust = PlannerSettings.model_fields["trust"].default
    assert trust == 0.5
    async with bench.planner(trust=trust, expected_communication_s=expected_s) as rig:
        await rig.layout(tp=1, dp=2, pp=2, gpus_per_node=1, microbatches=8,
                         dp_allreduce_bytes=4e9, pp_activation_bytes=1e7)
        inc = await rig.incident(kind="comm_slow", before_s=1.0, after_s=2.0, links=[(0, 1)])
        await rig.wait(lambda: _tracked(rig, inc), "the escalation to start")
        await rig.iterations(2.0, iterations - 1)
        await rig.wait(lambda: _fed(rig, inc, iterations - 1), "the slow iterations")
        assert await rig.plans() == []
        await rig.iterations(2.0, 1)
        (plan,) = await rig.wait(rig.plans, "an S3 proposal")
        assert plan.strategy == "S3" and plan.params.loss_s == pytest.approx(float(iterations))
        assert words in (plan.params.why or ""), plan.params.why
