"""The planner's 1F1B timing against closed forms and against the simulator's schedule."""

from __future__ import annotations

import numpy as np
import pytest

from greyhound.core.pipeline_1f1b import pipeline_makespan
from tests.sim.helpers import iteration_s, job


@pytest.mark.parametrize(("pp", "m"), [(1, 1), (2, 3), (4, 8), (8, 8), (3, 1), (5, 2)])
def test_uniform_stages_take_pp_minus_1_plus_m_micro_batches(pp: int, m: int) -> None:
    t = np.full((1, pp), 0.25)
    assert pipeline_makespan(t / 3, 2 * t / 3, m)[0] == pytest.approx((pp - 1 + m) * 0.25)


def test_fig12_one_slow_stage_costs_more_the_later_it_sits() -> None:
    base = np.ones(3)
    rows = np.array([base, [1.5, 1, 1], [1, 1.5, 1], [1, 1, 1.5], [1, 1.5, 1.5], [1.5, 1, 1.5]])
    got = pipeline_makespan(rows / 3, 2 * rows / 3, 4)
    np.testing.assert_allclose(got, [6.0, 7.0, 7.5, 8.0, 8.5, 8.5])


def test_equals_the_simulator_on_random_stage_speeds() -> None:
    rng = np.random.default_rng(11)
    for pp, m in ((2, 3), (3, 4), (4, 6), (5, 3)):
        factors = rng.choice([1.0, 1.25, 1.5, 2.0], size=pp)
        faults = [{"kind": "gpu_slow", "rank": s, "start_s": 0, "factor": float(f)}
                  for s, f in enumerate(factors) if f > 1]
        sim = iteration_s(job(pp=pp, microbatches=m, gpus_per_node=1, host_fraction=0.0), faults)
        ours = pipeline_makespan(factors[None] / 3, 2 * factors[None] / 3, m)[0]
        assert ours == pytest.approx(sim), (pp, m, factors)


def test_bad_shapes_are_value_errors() -> None:
    with pytest.raises(ValueError, match="differ in shape"):
        pipeline_makespan(np.ones((1, 3)), np.ones((1, 2)), 4)
    with pytest.raises(ValueError, match="microbatches"):
        pipeline_makespan(np.ones((1, 3)), np.ones((1, 3)), 0)
