"""S3 (a): a congested DP link handed to PP by swapping two nodes' roles (Fig. 11), in the simulator."""

from __future__ import annotations

from typing import Any

import pytest

from greyhound.core.layout import ParallelShape
from greyhound.core.plans import SwapGpusPlan, SwapNodesPlan
from greyhound.core.role_swap import Traffic, plan_role_swap
from tests.sim.helpers import iteration_s, job

# Fig. 11: PP2 x DP2 over four nodes, TP2 inside each node; stage 0 on nodes 0-1, stage 1 on 2-3.
SHAPE = ParallelShape(tp=2, dp=2, pp=2)
TRAFFIC = Traffic(gradient_bytes=8e9, activation_bytes=3e7, microbatches=8)
JOB = job(tp=2, dp=2, pp=2, gpus_per_node=2, microbatches=8, microbatch_compute_s=0.1,
          dp_allreduce_bytes=8e9, pp_activation_bytes=3e7, tp_allreduce_bytes=0,
          link_latency_us=5.0, nvlink_latency_us=1.0)


def congestion(a: int, b: int) -> list[dict[str, Any]]:
    return [{"kind": "link_congestion", "nodes": [a, b], "start_s": 0, "factor": 10.0}]


def test_fig11_link_3_4_under_dp_swap_nodes_2_and_3() -> None:
    """Counted from 0: link 2-3 carries stage 1's DP ring; swapping nodes 1 and 2 makes it PP."""
    plan = plan_role_swap(SHAPE, 2, {(2, 3): 10.0}, TRAFFIC)
    assert plan.node_pairs == ((1, 2),)
    assert plan.swaps == ((2, 4), (3, 5))
    assert plan.before[(2, 3)].dp_bytes > 0 and plan.before[(2, 3)].pp_bytes == 0
    assert plan.after[(2, 3)].dp_bytes == 0 and plan.after[(2, 3)].pp_bytes > 0
    assert plan.score_after < plan.score_before
    healthy = iteration_s(JOB)
    before = iteration_s(JOB, congestion(2, 3))
    after = iteration_s(JOB, congestion(2, 3), SwapGpusPlan(plan.swaps))
    assert after == pytest.approx(iteration_s(JOB, congestion(2, 3), SwapNodesPlan(plan.node_pairs)))
    print(f"\nFig. 11 in the simulator: healthy {healthy:.3f} s, link 2-3 congested under DP "
          f"{before:.3f} s, after swapping nodes 1 and 2 {after:.3f} s")
    assert before > 2 * healthy
    assert after < 1.1 * healthy


def test_link_already_under_pp_needs_nothing() -> None:
    plan = plan_role_swap(SHAPE, 2, {(0, 2): 10.0}, TRAFFIC)
    assert plan.node_pairs == () and plan.swaps == ()
    assert plan.score_after == plan.score_before


def test_no_swap_when_pp_traffic_would_cost_more() -> None:
    heavy_pp = Traffic(gradient_bytes=1e8, activation_bytes=1e9, microbatches=8)
    assert plan_role_swap(SHAPE, 2, {(2, 3): 10.0}, heavy_pp).node_pairs == ()


def test_two_congested_links_one_swap_each_while_it_helps() -> None:
    shape = ParallelShape(tp=1, dp=2, pp=4)  # one GPU per node: node = GPU = rank
    traffic = Traffic(gradient_bytes=8e9, activation_bytes=3e7, microbatches=8)
    plan = plan_role_swap(shape, 1, {(0, 1): 10.0, (6, 7): 10.0}, traffic)
    assert len(plan.node_pairs) == 2
    assert all(v.dp_bytes == 0 for v in plan.after.values())
    j = job(dp=2, pp=4, gpus_per_node=1, microbatches=8, microbatch_compute_s=0.1,
            dp_allreduce_bytes=8e9, pp_activation_bytes=3e7)
    links = congestion(0, 1) + congestion(6, 7)
    assert iteration_s(j, links, SwapGpusPlan(plan.swaps)) < 0.6 * iteration_s(j, links)


@pytest.mark.parametrize(
    ("links", "gpus_per_node", "message"),
    [({(2, 2): 10.0}, 2, "distinct"), ({(2, 9): 10.0}, 2, "distinct nodes"),
     ({(2, 3): 1.0}, 2, "> 1"), ({(2, 3): 10.0}, 3, "divide")],
)
def test_bad_input_is_a_value_error(links: dict[tuple[int, int], float], gpus_per_node: int,
                                    message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_role_swap(SHAPE, gpus_per_node, links, TRAFFIC)
