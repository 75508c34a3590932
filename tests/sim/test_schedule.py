"""Closed forms the schedule must reproduce exactly."""

from __future__ import annotations

import pytest

from greyhound.sim.schedule import ring_allreduce_s
from tests.sim.helpers import iteration_s, job


@pytest.mark.parametrize(("pp", "m"), [(1, 1), (2, 3), (4, 8), (8, 8), (3, 1)])
def test_uniform_1f1b_is_pp_minus_1_plus_m_times_t(pp: int, m: int) -> None:
    t = 0.25
    assert iteration_s(job(pp=pp, microbatches=m, microbatch_compute_s=t)) == pytest.approx(
        (pp - 1 + m) * t
    )


@pytest.mark.parametrize("n", [2, 3, 8, 16])
def test_dp_ring_allreduce_is_2_n_minus_1_over_n_bytes_over_bandwidth(n: int) -> None:
    nbytes, gbps = 4.0e9, 400.0
    j = job(dp=n, microbatches=n, microbatch_compute_s=0.5, dp_allreduce_bytes=nbytes,
            link_gbps=gbps, gpus_per_node=1, dp_algorithm="ring")
    expected = 2 * (n - 1) / n * nbytes / (gbps * 1e9 / 8)
    assert iteration_s(j) - 0.5 == pytest.approx(expected)
    assert ring_allreduce_s(n, nbytes, gbps * 1e9 / 8, 0.0) == pytest.approx(expected)


def test_paper_fig12_consolidating_stragglers_into_one_stage() -> None:
    """PP3, 4 micro-batches of 1 s, stragglers at 1.5 s: 6 s, 8.5 s spread, 8 s consolidated."""
    j = job(pp=3, microbatches=4, gpus_per_node=1, host_fraction=0.0)

    def slow(*gpus: int) -> list[dict[str, object]]:
        return [{"kind": "gpu_slow", "rank": g, "start_s": 0, "factor": 1.5} for g in gpus]

    assert iteration_s(j) == pytest.approx(6.0)
    assert iteration_s(j, slow(1, 2)) == pytest.approx(8.5)  # stages 1 and 2
    assert iteration_s(j, slow(0, 2)) == pytest.approx(8.5)
    assert iteration_s(j, slow(2)) == pytest.approx(8.0)  # both in stage 2
    # The inner stage costs less still, which is why the planner prefers inner stages.
    assert iteration_s(j, slow(1)) == pytest.approx(7.5)


def test_tree_wins_for_small_messages_on_many_ranks_ring_for_large() -> None:
    from greyhound.sim.model import ClusterModel
    from tests.sim.helpers import scenario

    small = job(dp=64, microbatches=64, gpus_per_node=1, dp_allreduce_bytes=1e4,
                link_latency_us=5.0)
    big = dict(small, dp_allreduce_bytes=4e9)
    assert ClusterModel(scenario(small)).iteration(0.0).dp_algorithm == ("tree",)
    assert ClusterModel(scenario(big)).iteration(0.0).dp_algorithm == ("ring",)
