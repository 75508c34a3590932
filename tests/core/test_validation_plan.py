"""The validator's pure planning: pause point, GEMM set, P2P rounds."""

from __future__ import annotations

import pytest

from greyhound.core.validation_plan import (
    PAUSE_AHEAD,
    CommView,
    cut,
    gemm_ranks,
    link_classes,
    members,
    pack_rounds,
    pause_plan,
    reference_comms,
    suspect_comms,
    transfer_rounds,
)
from greyhound.hookabi import unsigned64

WORLD_ID = (1 << 64) - 5  # a comm id with the top bit set, as hashes often are


def _dp_tp(world: int, tp: int) -> dict[int, list[CommView]]:
    """TP groups of ``tp`` consecutive ranks, DP groups across them; TP is the busier comm."""
    dp = world // tp
    out: dict[int, list[CommView]] = {}
    for r in range(world):
        t, d = r % tp, r // tp
        out[r] = [CommView(100 + d, t, tp, 50 + r % 2), CommView(200 + t, d, dp, 10 + r % 3)]
    return out


def test_pause_at_the_iteration_boundary_beyond_every_rank() -> None:
    plan = pause_plan(_dp_tp(8, 2))
    assert plan.comm_of_rank == {r: 200 + r % 2 for r in range(8)}  # DP: fewer collectives
    assert plan.seq_of_comm == {200: 12 + 2, 201: 12 + 2}
    assert {plan.seq_of_rank(r) for r in range(8)} == {14}


def test_equal_sizes_pick_the_less_busy_kind_on_every_rank() -> None:
    plan = pause_plan(_dp_tp(4, 2))  # TP and DP both have 2 ranks; DP sees fewer collectives
    assert plan.comm_of_rank == {r: 200 + r % 2 for r in range(4)}
    assert set(plan.seq_of_comm.values()) == {12 + 2}
    with pytest.raises(ValueError, match="rank 3"):
        pause_plan({3: []})


def _tp_dp_pp(tp: int, dp: int, pp: int) -> dict[int, list[CommView]]:
    """Megatron's layout: TP groups of consecutive ranks (the largest and busiest, many
    collectives an iteration), DP across them (one all-reduce an iteration), PP pairs across
    stages (send/receive only: no collective sequence)."""
    out: dict[int, list[CommView]] = {}
    for r in range(tp * dp * pp):
        t, d, s = r % tp, (r // tp) % dp, r // (tp * dp)
        out[r] = [CommView(100 + s * dp + d, t, tp, 400 + r % 3),
                  CommView(200 + s * tp + t, d, dp, 30 + r % 2),
                  CommView(300 + d * tp + t, s, pp, 0)]
    return out


def test_a_pipeline_parks_every_stage_at_its_dp_all_reduce() -> None:
    """Parking on TP all-reduce #S would stop the stages at different points of the 1F1B
    schedule (a queued receive waiting for a parked sender: a drain that never ends)."""
    comms = _tp_dp_pp(8, 4, 2)
    plan = pause_plan(comms)
    assert plan.comm_of_rank == {r: next(c.comm_id for c in comms[r] if c.nranks == 4)
                                 for r in comms}
    assert set(plan.seq_of_comm.values()) == {31 + 2}
    # A rank's status missing: no kind covers the job, each rank takes its largest comm.
    del comms[63]
    assert set(pause_plan(comms).comm_of_rank.values()) == {100 + g for g in range(8)}


def _stages(rates: list[int], iterations: int, offsets: list[int] | None = None
            ) -> dict[int, list[CommView]]:
    """TP1 x DP2 x PP len(rates): stage s's DP communicator (ranks 2s, 2s+1) enters rates[s]
    collectives an iteration (its buckets), plus offsets[s] taken mid-iteration by one member."""
    out: dict[int, list[CommView]] = {}
    for s, k in enumerate(rates):
        extra = (offsets or [0] * len(rates))[s]
        for d in range(2):
            out[2 * s + d] = [CommView(500 + s, d, 2, k * iterations + (extra if d else 0)),
                              CommView(900 + d, s, len(rates), 0)]  # the PP pair: send/recv only
    return out


def _iteration(seq: int, rate: int) -> tuple[int, int]:
    """(iteration, bucket) of collective ``seq`` (from 1) on a communicator of ``rate``."""
    return (seq - 1) // rate, (seq - 1) % rate


@pytest.mark.parametrize("rates", [[1, 2], [2, 3], [3, 4, 4, 5], [1, 1, 1]])
def test_stages_whose_dp_communicators_advance_at_different_rates_stop_at_one_iteration(
        rates: list[int]) -> None:
    """One absolute sequence number for every DP communicator stops a stage whose communicator
    takes two collectives an iteration after half as many iterations as a stage taking one, whose
    ranks then never get there (their pipeline peers are parked): each communicator gets its own
    number, at the start of the same iteration."""
    for offsets in (None, [1] * len(rates)):  # a member's status taken a collective later
        plan = pause_plan(_stages(rates, 40, offsets))
        assert set(plan.comm_of_rank.values()) == {500 + s for s in range(len(rates))}
        where = {_iteration(plan.seq_of_comm[500 + s], k) for s, k in enumerate(rates)}
        # 40 iterations done (one member into the 41st): PAUSE_AHEAD iterations on from there
        ahead = 40 + PAUSE_AHEAD - (0 if offsets else 1)
        assert where == {(ahead, 0)}, (rates, offsets, plan.seq_of_comm)
    assert cut({}) == {} and cut({7: 0, 8: 0}) == {7: PAUSE_AHEAD, 8: PAUSE_AHEAD}


def test_members_in_comm_rank_order_and_incomplete_comms_dropped() -> None:
    comms = {r: [CommView(-5, (r + 1) % 4, 4, 0)] for r in range(4)}
    assert members(comms) == {WORLD_ID: [3, 0, 1, 2]}
    del comms[0]
    assert members(comms) == {}


def test_gemm_set_is_the_suspects_groups() -> None:
    comms = _dp_tp(8, 2)
    groups = members(comms)
    assert gemm_ranks([5], [], groups, comms) == [1, 3, 4, 5, 7]  # TP pair and DP group of 5
    assert gemm_ranks([], [100], groups, comms) == [0, 1]
    assert gemm_ranks([], [], groups, comms) == list(range(8))


def test_suspect_comms() -> None:
    comms = _dp_tp(8, 2)
    groups = members(comms)
    assert suspect_comms("comm_slow", [101, 999], [], groups, comms) == [101]
    assert suspect_comms("compute_slow", [], [3], groups, comms) == []
    assert suspect_comms("mixed_slow", [], [3], groups, comms) == [201]


@pytest.mark.parametrize(("n", "rounds", "links"),
                         [(4, 3, 6), (5, 5, 8), (8, 5, 14), (2, 1, 1), (64, 5, 126)])
def test_ring_and_tree_rounds_use_each_rank_once_per_round(n: int, rounds: int,
                                                           links: int) -> None:
    group = [10 * i for i in range(n)]
    comms = {g: [CommView(7, i, n, 0)] for i, g in enumerate(group)}
    plan = transfer_rounds([7], members(comms))
    assert len(plan) == rounds
    seen = [frozenset(t.link) for batch in plan for t in batch]
    assert len(seen) == len(set(seen)) == links
    for batch in plan:
        used = [r for t in batch for r in t.link]
        assert len(used) == len(set(used))
        for t in batch:
            assert group[t.src_comm_rank] == t.src and group[t.dst_comm_rank] == t.dst
            assert t.comm_id == unsigned64(7)


def test_disjoint_groups_share_rounds() -> None:
    comms = _dp_tp(8, 2)
    one = transfer_rounds([200], members(comms))
    both = transfer_rounds([200, 201], members(comms))
    assert len(both) == len(one) and sum(map(len, both)) == 2 * sum(map(len, one))
    assert pack_rounds([]) == []


def test_reference_comm_is_a_healthy_look_alike_on_other_nodes() -> None:
    # s16-like: TP2 x DP4 x PP2, 4 GPUs a node. DP groups of stage 0 span nodes 0-1, of stage 1
    # nodes 2-3; TP groups stay in one node.
    groups = {100: [0, 2, 4, 6], 101: [1, 3, 5, 7], 102: [8, 10, 12, 14], 103: [9, 11, 13, 15],
              1: [0, 1], 2: [8, 9]}
    node = {r: r // 4 for r in range(16)}
    assert reference_comms([100, 101], groups, node) == [102]  # one per shape of group
    assert reference_comms([100], groups, node) == [102]  # not 101: it shares nodes 0 and 1
    assert reference_comms([1, 100], groups, node) == [2, 102]
    assert reference_comms([100, 101, 102, 103], groups, node) == []  # nothing left to compare
    # the reference runs alongside the suspect's rounds: no extra round
    assert len(transfer_rounds([100, 102], groups)) == len(transfer_rounds([100], groups))


def test_link_classes_by_node() -> None:
    node = {0: 0, 1: 0, 2: 1}
    assert link_classes([(0, 1), (1, 2), (2, 9)], node) == {
        (0, 1): "nvlink", (1, 2): "network", (2, 9): "network"}  # rank 9's node is unknown
