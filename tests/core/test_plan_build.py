"""Plans built from validated culprits (pure): S2 from the slow DP group's measured time, S3 a
role swap for a slow link or a consolidation for slow GPUs, S4 a priced recommendation; what
would change nothing is no plan; deliveries and reverts as absolute job states."""

from __future__ import annotations

import numpy as np
import pytest

from greyhound.core.escalation import Strategy
from greyhound.core.microbatch import allocate_microbatches
from greyhound.core.plan_build import (
    Culprit,
    JobState,
    Layout,
    PlanCosts,
    available,
    next_state,
    propose,
    restart_overhead,
    undo_swaps,
)
from greyhound.core.plans import even_split

# the planner's default costs (services.planner.settings)
S = PlanCosts(gradient_bytes=1e9, activation_bytes=1e7, consolidate_time_limit_s=5.0,
              restart_write_bytes_per_s=10e9, restart_read_bytes_per_s=20e9,
              restart_overhead_s=600.0, s4_overhead_s=3600.0)
DP4 = Layout(tp=2, dp=4, pp=2, gpus_per_node=4, microbatches=16)


def test_culprit_takes_the_gemm_ratio_else_the_iteration_slowdown() -> None:
    gemm = {"3": 3.0, "2": 1.0, "4": 1.5, "5": 1.0, "x": 9.0}
    c = Culprit.from_validation(gpu_ranks=[3], link_ranks=[(0, 2)], gemm_s=gemm, slowdown=1.4)
    assert c.gpu_ranks == {3: 3.0} and c.link_ranks == ((0, 2),) and c.slowdown == 1.4
    bare = Culprit.from_validation(gpu_ranks=[3], link_ranks=[(0, 2)], gemm_s={}, slowdown=1.4)
    assert bare.gpu_ranks == {3: 1.4}
    assert Culprit.from_validation(gpu_ranks=[], link_ranks=[], gemm_s={}, slowdown=2.0).empty


def test_s2_gives_the_slow_dp_group_fewer_micro_batches() -> None:
    # rank 2 = (stage 0, DP group 1, TP 0); its GPU runs at half speed
    p = propose(Strategy.MICROBATCH, DP4, Culprit({2: 2.0}), JobState(), S)
    assert p is not None and p.strategy == "S2"
    want = allocate_microbatches([1.0, 2.0, 1.0, 1.0], 16)
    assert p.microbatches == want.counts and p.params["slow_dp_groups"] == [1]
    assert p.expected_gain == pytest.approx(8.0 / want.makespan)
    # already running that split: nothing to change
    assert propose(Strategy.MICROBATCH, DP4, Culprit({2: 2.0}),
                   JobState(microbatches=want.counts), S) is None
    # multiple_of is kept
    lay = Layout(tp=1, dp=2, pp=2, gpus_per_node=2, microbatches=8, multiple_of=2)
    p2 = propose(Strategy.MICROBATCH, lay, Culprit({0: 3.0}), JobState(), S)
    assert p2 is not None and p2.microbatches is not None
    assert all(c % 2 == 0 for c in p2.microbatches) and sum(p2.microbatches) == 8


def test_s3_role_swap_moves_the_link_to_pipeline_traffic() -> None:
    # TP1 DP2 PP2 on one GPU per node: stage 0's DP ring is ranks 0-1, nodes 0-1
    lay = Layout(tp=1, dp=2, pp=2, gpus_per_node=1, microbatches=8, dp_allreduce_bytes=4e9,
                    pp_activation_bytes=1e7)
    p = propose(Strategy.TOPOLOGY, lay, Culprit(link_ranks=((0, 1),), slowdown=2.0), JobState(), S)
    assert p is not None and p.params["kind"] == "role_swap" and p.params["links"] == [[0, 1]]
    assert p.gpu_of_rank is not None and sorted(p.gpu_of_rank) == [0, 1, 2, 3]
    assert p.params["score_after"] < p.params["score_before"]
    assert p.expected_gain is not None and 1.0 < p.expected_gain <= 2.0
    # after the swap the ranks on GPUs 0 and 1 (nodes 0-1) exchange no DP traffic: the same
    # link gives no further swap
    moved = JobState(gpu_of_rank=p.gpu_of_rank)
    on = {g: r for r, g in enumerate(p.gpu_of_rank)}
    assert propose(Strategy.TOPOLOGY, lay, Culprit(link_ranks=((on[0], on[1]),), slowdown=2.0),
                   moved, S) is None
    # ranks on one node: no network link to move
    one_node = Layout(tp=1, dp=2, pp=2, gpus_per_node=4, microbatches=8)
    assert propose(Strategy.TOPOLOGY, one_node, Culprit(link_ranks=((0, 1),), slowdown=2.0),
                   JobState(), S) is None


def test_s3_consolidation_gathers_slow_gpus_into_one_stage() -> None:
    lay = Layout(tp=1, dp=2, pp=4, gpus_per_node=8, microbatches=8)
    # ranks 2 (stage 1) and 5 (stage 2) are slow: one stage should hold both
    p = propose(Strategy.TOPOLOGY, lay, Culprit({2: 1.5, 5: 1.5}), JobState(), S)
    assert p is not None and p.params["kind"] == "consolidate"
    assert len({c[0] for c in p.params["cells"]}) == 1 and p.swaps
    assert p.expected_gain is not None and p.expected_gain > 1.0


def test_s4_recommends_replacing_parts_and_prices_the_restart() -> None:
    lay = Layout(tp=2, dp=4, pp=2, gpus_per_node=4, microbatches=16, checkpoint_bytes=1e12)
    p = propose(Strategy.RESTART, lay, Culprit({5: 2.0}, ((0, 8),), 2.0), JobState(), S)
    assert p is not None and p.strategy == "S4" and p.gpu_of_rank is None
    assert p.params["replace_gpus"] == [5] and p.params["links"] == [[0, 2]]
    cost = 1e12 / S.restart_write_bytes_per_s + 1e12 / S.restart_read_bytes_per_s \
        + S.restart_overhead_s
    assert p.params["cost_s"] == pytest.approx(cost) == restart_overhead(lay, S)
    assert restart_overhead(DP4, S) == S.s4_overhead_s


def test_available_strategies_follow_the_culprit_and_layout() -> None:
    assert available(DP4, Culprit({2: 2.0})) == {Strategy.MICROBATCH, Strategy.TOPOLOGY,
                                                 Strategy.RESTART}
    flat = Layout(tp=1, dp=1, pp=1, gpus_per_node=1, microbatches=4)
    assert available(flat, Culprit({0: 2.0})) == {Strategy.RESTART}
    assert Strategy.MICROBATCH not in available(DP4, Culprit(link_ranks=((0, 4),)))


def test_states_are_absolute_and_the_default_reads_as_none() -> None:
    s, swaps = next_state(JobState(), DP4, microbatches=(5, 3, 4, 4), gpu_of_rank=None)
    assert s == JobState((5, 3, 4, 4), None) and swaps == ()
    back, _ = next_state(s, DP4, microbatches=even_split(16, 4), gpu_of_rank=None)
    assert back == JobState()
    target = tuple(int(g) for g in np.roll(np.arange(16), 4))
    moved, swaps = next_state(s, DP4, microbatches=None, gpu_of_rank=target)
    assert moved == JobState((5, 3, 4, 4), target) and len(swaps) == 12
    assert undo_swaps(moved, DP4, swaps) == tuple(range(16))
