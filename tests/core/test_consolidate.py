"""S3 (b): stragglers consolidated into the fewest, cheapest stages, checked in the simulator."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from greyhound.core.consolidate import plan_consolidation
from greyhound.core.layout import ParallelShape, swaps_between
from greyhound.core.plans import SwapGpusPlan
from tests.sim.helpers import iteration_s, job

# Fig. 12 in its units: PP3, micro-batch 1 s (forward 1/3, backward 2/3), stragglers at 1.5 s,
# 4 micro-batches; two GPUs per stage (TP2, one node per stage) so two stragglers fit in one.
FIG12 = ParallelShape(tp=2, dp=1, pp=3)
FIG12_JOB = job(tp=2, pp=3, microbatches=4, gpus_per_node=2, host_fraction=0.0, tp_allreduce_bytes=0)


def slow(gpus: dict[int, float]) -> list[dict[str, Any]]:
    return [{"kind": "gpu_slow", "rank": g, "start_s": 0, "factor": f} for g, f in gpus.items()]


def test_fig12_two_stages_consolidated_into_one() -> None:
    stragglers = {2: 1.5, 5: 1.5}  # stage 1 (tp 0) and stage 2 (tp 1)
    plan = plan_consolidation(FIG12, stragglers, microbatches=4)
    assert plan.before_s == pytest.approx(8.5)
    assert len(plan.cells) == 1  # ceil(2 stragglers / 2 GPUs per stage)
    # Uniform stages: the exact schedule favours the first stage (7.0 s against 7.5 and 8.0).
    assert plan.cells == ((0, 0),)
    assert plan.after_s == pytest.approx(7.0)
    assert plan.method == "enumerated"
    assert iteration_s(FIG12_JOB, slow(stragglers)) == pytest.approx(8.5)
    after = iteration_s(FIG12_JOB, slow(stragglers), SwapGpusPlan(plan.swaps))
    assert after == pytest.approx(plan.after_s)
    assert after <= 8.0


@pytest.mark.parametrize(("stage", "expected"), [(0, 7.0), (1, 7.5), (2, 8.0)])
def test_fig12_each_consolidated_layout_in_the_simulator(stage: int, expected: float) -> None:
    """Both stragglers moved into one stage by hand: 7-8 s depending on the stage, all <= 8 s."""
    stragglers = {2: 1.5, 5: 1.5}
    layout = np.arange(6)
    # Stage ``stage``'s two ranks get GPUs 2 and 5; the other GPUs fill the other ranks in order.
    healthy = iter(g for g in range(6) if g not in stragglers)
    target = np.array([(2, 5)[r - 2 * stage] if r // 2 == stage else next(healthy) for r in range(6)])
    got = iteration_s(FIG12_JOB, slow(stragglers), SwapGpusPlan(swaps_between(layout, target)))
    assert got == pytest.approx(expected)


def test_heavier_first_and_last_stages_send_stragglers_inside() -> None:
    """With embedding and loss work on the end stages (1.5x), the inner stage is the cheapest."""
    forward, backward = [0.5, 1 / 3, 0.5], [1.0, 2 / 3, 1.0]
    plan = plan_consolidation(FIG12, {2: 1.5, 5: 1.5}, microbatches=4,
                              stage_forward_s=forward, stage_backward_s=backward)
    assert plan.cells == ((1, 0),)
    assert plan.swaps == ((3, 5),)  # GPU 2 already sits in stage 1; GPU 5 joins it
    assert plan.after_s < plan.before_s


def test_already_consolidated_stays_put() -> None:
    plan = plan_consolidation(FIG12, {0: 1.5, 1: 1.5}, microbatches=4)
    assert plan.swaps == () and plan.method == "unchanged"
    assert plan.after_s == pytest.approx(7.0)


def test_stragglers_spread_over_pipelines_share_one_stage() -> None:
    """DP2 PP4 TP1: two stragglers need ceil(2 / 2) = 1 stage, one GPU in each pipeline."""
    shape = ParallelShape(tp=1, dp=2, pp=4)
    stragglers = {1: 1.5, 6: 1.5}  # stage 0 of pipeline 1, stage 3 of pipeline 0
    plan = plan_consolidation(shape, stragglers, microbatches=8)
    assert [s for s, _ in plan.cells] == [0, 0]
    j = job(dp=2, pp=4, microbatches=16, gpus_per_node=1, host_fraction=0.0)
    before = iteration_s(j, slow(stragglers))
    after = iteration_s(j, slow(stragglers), SwapGpusPlan(plan.swaps))
    assert after == pytest.approx(plan.after_s)
    assert after < before


def test_milp_when_stragglers_differ_and_pipelines_are_uneven() -> None:
    """No closed form: unequal severities, and S2 left the pipelines with 6 and 10 micro-batches.
    The MILP's layout, timed exactly and then in the simulator, beats the current one."""
    shape = ParallelShape(tp=1, dp=2, pp=4)
    stragglers = {1: 1.5, 6: 1.3, 7: 1.5}
    plan = plan_consolidation(shape, stragglers, microbatches=[6, 10], time_limit_s=20)
    assert plan.method in ("milp", "enumerated")
    assert plan.after_s < plan.before_s
    j = job(dp=2, pp=4, microbatches=16, gpus_per_node=1, host_fraction=0.0)
    from greyhound.core.plans import MicrobatchPlan

    counts = MicrobatchPlan((6, 10))
    before = iteration_s(j, slow(stragglers), counts)
    after = iteration_s(j, slow(stragglers), counts, SwapGpusPlan(plan.swaps))
    assert before == pytest.approx(plan.before_s)
    assert after == pytest.approx(plan.after_s)


def test_milp_layout_is_used_when_enumeration_is_too_large() -> None:
    shape = ParallelShape(tp=2, dp=1, pp=4)
    stragglers = {0: 1.5, 3: 1.5, 5: 1.5}
    plan = plan_consolidation(shape, stragglers, microbatches=4, max_enumerated=0, time_limit_s=20)
    assert plan.method == "milp"
    assert len(plan.cells) == 2  # ceil(3 / 2)
    j = job(tp=2, pp=4, microbatches=4, gpus_per_node=2, host_fraction=0.0, tp_allreduce_bytes=0)
    after = iteration_s(j, slow(stragglers), SwapGpusPlan(plan.swaps))
    assert after == pytest.approx(plan.after_s)
    assert after < iteration_s(j, slow(stragglers))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stragglers": {9: 1.5}}, "out of range"),
        ({"stragglers": {0: 0.5}}, ">= 1"),
        ({"microbatches": 0}, "at least one"),
        ({"stage_forward_s": [1.0, 1.0]}, "3 positive"),
        ({"gpu_of_rank": [0, 0, 1, 2, 3, 4]}, "permutation"),
    ],
)
def test_bad_input_is_a_value_error(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"stragglers": {2: 1.5}, "microbatches": 4} | kwargs
    with pytest.raises(ValueError, match=message):
        plan_consolidation(FIG12, args.pop("stragglers"), **args)


def test_swaps_realise_the_layout_for_random_jobs_and_layouts() -> None:
    """Whatever the starting layout, the swaps turn it into the plan's layout, every straggler
    ends in one of the plan's cells, and no cell holds more stragglers than it has GPUs."""
    rng = np.random.default_rng(5)
    for _ in range(25):
        tp, dp, pp = (int(x) for x in rng.integers((1, 1, 2), (3, 3, 5)))
        shape = ParallelShape(tp=tp, dp=dp, pp=pp)
        start = rng.permutation(shape.world)
        k = int(rng.integers(1, shape.world))
        stragglers = {int(g): 1.5 for g in rng.choice(shape.world, size=k, replace=False)}
        plan = plan_consolidation(shape, stragglers, microbatches=4, gpu_of_rank=start)
        layout = start.copy()
        rank_of = np.argsort(layout)
        for a, b in plan.swaps:
            rank_of[[a, b]] = rank_of[[b, a]]
        layout[rank_of] = np.arange(shape.world)
        assert layout.tolist() == list(plan.gpu_of_rank)
        stage, group, _ = shape.coords(rank_of[list(stragglers)])
        cells = list(zip(stage.tolist(), group.tolist(), strict=True))
        assert set(cells) == set(plan.cells)
        assert max(cells.count(c) for c in set(cells)) <= shape.tp
        assert plan.after_s <= plan.before_s + 1e-12
