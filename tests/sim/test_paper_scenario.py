"""The paper demo's scenario is the experiment the issue describes, and the simulator's S2 and S3
effects are the exact 1F1B schedule's (greyhound.core.pipeline_1f1b), not a constant factor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from greyhound.core.pipeline_1f1b import pipeline_makespan
from greyhound.core.plans import MicrobatchPlan, SwapGpusPlan
from greyhound.sim.model import ClusterModel
from greyhound.sim.scenario import load_scenario
from greyhound.sim.score import expectations
from greyhound.sim.throughput import offline_iterations, over_time, per_minute
from tests.sim.helpers import job, scenario

PAPER = Path(__file__).resolve().parents[2] / "scenarios" / "paper-256.yaml"


def test_the_paper_scenario_is_the_issues_experiment() -> None:
    sc = load_scenario(PAPER)
    j = sc.job
    assert (j.world, j.tp, j.dp, j.pp) == (256, 8, 16, 2)
    kinds = [f.kind for f in sc.faults]
    assert len(kinds) == 12 and kinds.count("link_congestion") == 2
    gpu = sorted(f.factor for f in sc.faults if f.kind == "gpu_slow")
    assert len(gpu) == 10
    assert (gpu.count(1.5), gpu.count(2.0), gpu.count(3.0)) == (3, 5, 2)  # weak, medium, strong
    # a compound case: a link and a GPU slow at once
    exp = expectations(sc, compound="either")
    assert any("mixed_slow" in e.kinds and e.link is not None for e in exp)
    assert sc.follows_plans and all(f.end_s <= sc.duration_s for f in sc.faults)
    # without mitigation the job loses what the paper's lost: 18.9 of 37.4 it/min (50.5%)
    healthy = per_minute(offline_iterations(sc, faults=False), sc.duration_s)
    without = per_minute(offline_iterations(sc), sc.duration_s)
    assert without / healthy == pytest.approx(18.9 / 37.4, abs=0.01)


def test_throughput_counts_iterations_by_their_end() -> None:
    its = [(0.0, 1.0), (1.0, 2.0), (3.0, 2.0), (5.0, 30.0)]
    assert per_minute(its, 6.0) == 30.0  # ends 1, 3, 5 within 6 s: 3 per 6 s
    x, y = over_time(its, 6.0, 3.0)
    assert list(x) == [1.5, 4.5] and list(y) == [20.0, 40.0]
    with pytest.raises(ValueError):
        per_minute(its, 0.0)


# One GPU per "node", free transfers and collectives: the iteration is the slowest DP group's
# 1F1B makespan alone, so the model can be held to the exact schedule.
J = job(tp=1, dp=4, pp=4, gpus_per_node=1, microbatches=16, microbatch_compute_s=0.1,
        host_fraction=0.01)
SLOW = [{"kind": "gpu_slow", "rank": 5, "start_s": 0, "factor": 2.0}]  # dp 1, stage 1


def schedule_s(counts: tuple[int, ...], slow_cells: dict[tuple[int, int], float]) -> float:
    """The exact 1F1B makespan of each DP group (its stages' per-micro-batch times), slowest."""
    ff = 1.0 / 3.0
    out = []
    for d, m in enumerate(counts):
        rel = np.array([slow_cells.get((s, d), 1.0) for s in range(4)])
        out.append(float(pipeline_makespan(0.1 * ff * rel[None, :], 0.1 * (1 - ff) * rel[None, :],
                                           m)[0]))
    return max(out)


def iteration(*plans: object) -> float:
    model = ClusterModel(scenario(J, SLOW))
    for p in plans:
        model.apply_plan(p)
    return model.iteration(0.0, events=False).duration_s


def test_s2_gains_what_the_1f1b_schedule_of_the_new_counts_gives() -> None:
    before = iteration()
    assert before == pytest.approx(schedule_s((4, 4, 4, 4), {(1, 1): 2.0}), rel=1e-9)
    counts = (5, 2, 5, 4)  # the slow group gives micro-batches to the others
    after = iteration(MicrobatchPlan(counts))
    assert after == pytest.approx(schedule_s(counts, {(1, 1): 2.0}), rel=1e-9)
    # not a constant: the same re-balance gains less when the slow stage is the first one
    first = ClusterModel(scenario(J, [{**SLOW[0], "rank": 1}]))
    first.apply_plan(MicrobatchPlan(counts))
    assert first.iteration(0.0, events=False).duration_s == pytest.approx(
        schedule_s(counts, {(0, 1): 2.0}), rel=1e-9)
    assert before / after != pytest.approx(schedule_s((4, 4, 4, 4), {(0, 1): 2.0})
                                           / schedule_s(counts, {(0, 1): 2.0}), rel=1e-3)


def test_s3_moves_the_slow_gpu_and_the_schedule_follows_it() -> None:
    # GPU 5 (dp 1, stage 1) swaps ranks with GPU 13 (dp 1, stage 3): the slow cell moves to
    # the last stage of the same pipeline, which 1F1B makes cost more
    after = iteration(SwapGpusPlan(((5, 13),)))
    assert after == pytest.approx(schedule_s((4, 4, 4, 4), {(3, 1): 2.0}), rel=1e-9)
    assert after > iteration()
