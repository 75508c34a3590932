"""S2 in the simulator: a compute straggler's DP group given fewer micro-batches, the job faster."""

from __future__ import annotations

import numpy as np
import pytest

from greyhound.core.microbatch import allocate_microbatches
from greyhound.core.plans import MicrobatchPlan
from greyhound.sim.model import ClusterModel
from tests.sim.helpers import iteration_s, job, scenario


@pytest.mark.parametrize(("dp", "pp", "factor", "total", "share"),
                         [(4, 2, 1.85, 64, 0.8), (8, 1, 1.3, 64, 0.45), (4, 4, 1.5, 64, 0.35)])
def test_rebalanced_iteration_is_shorter(dp: int, pp: int, factor: float, total: int, share: float) -> None:
    """``share``: the part of the straggler's slowdown S2 must win back at least. S2's model (a
    group's time = micro-batches x its slowest stage) ignores the pipeline's fill and drain, so
    deeper pipelines keep more of the slowdown, and whole micro-batches bound how close it gets."""
    j = job(dp=dp, pp=pp, gpus_per_node=8, microbatches=total, microbatch_compute_s=0.05,
            dp_allreduce_bytes=1e9, pp_activation_bytes=5e7, optimizer_s=0.01)
    faults = [{"kind": "gpu_slow", "rank": dp * (pp - 1), "start_s": 0, "factor": factor}]
    # Profiling, as the analyzer would: each group's pace is its slowest stage's micro-batch time.
    comp = ClusterModel(scenario(j, faults)).derived(0.0).comp
    per_group = comp.max(axis=(0, 2))
    assert np.argmax(per_group) == 0
    plan = allocate_microbatches(per_group, j["microbatches"], multiple_of=pp)
    assert plan.counts[0] < min(plan.counts[1:])
    healthy = iteration_s(j)
    before = iteration_s(j, faults)
    after = iteration_s(j, faults, MicrobatchPlan(plan.counts))
    print(f"\nS2 DP{dp} PP{pp} x{factor}: healthy {healthy:.3f} s, slow {before:.3f} s, "
          f"re-balanced {plan.counts} {after:.3f} s")
    assert after < before - share * (before - healthy), (healthy, before, after, plan.counts)
