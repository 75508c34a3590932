"""The framework-free side of S3 in a job: deliveries, roles, groups and moves (no PyTorch)."""

from __future__ import annotations

import pytest

from greyhound.core.consolidate import plan_consolidation
from greyhound.core.layout import ParallelShape
from greyhound.core.role_swap import Traffic, plan_role_swap
from greyhound.integrations.topology import (
    Delivery,
    LayoutError,
    Role,
    Transfer,
    check_group_order,
    group_members,
    layout,
    roles,
    transfers,
)

PP2_DP2 = ParallelShape(tp=1, dp=2, pp=2)


def test_a_delivery_parses_as_the_api_serves_it_and_bad_fields_are_named() -> None:
    body = {"job_id": "j", "version": 3, "plan_id": "p", "strategy": "S3", "action": "apply",
            "microbatches": None, "gpu_of_rank": [0, 2, 1, 3], "swaps": [[1, 2]], "cost_s": 60.0,
            "summary": "", "issued_at": None, "reported": None}
    d = Delivery.parse(body)
    assert d == Delivery(3, None, (0, 2, 1, 3), ((1, 2),), "S3", "apply")
    assert Delivery.parse(d) is d
    with pytest.raises(ValueError, match="gpu_of_rank must hold integers"):
        Delivery.parse({"version": 1, "gpu_of_rank": [0, "1"]})
    with pytest.raises(ValueError, match="microbatches must be a list"):
        Delivery.parse({"version": 1, "microbatches": "4,4"})
    with pytest.raises(ValueError, match="version"):
        Delivery.parse({"version": True})


def test_the_planners_role_swap_makes_two_processes_exchange_stages() -> None:
    """A congested link on stage 1's DP ring (nodes 2-3, one GPU a node): the role swap core
    exchanges GPUs 1 and 2, so process 1 runs stage 1 and process 2 stage 0."""
    plan = plan_role_swap(PP2_DP2, 1, {(2, 3): 4.0}, Traffic(1e9, 1e7, 4))
    before, after = layout(PP2_DP2, None), layout(PP2_DP2, plan.gpu_of_rank)
    assert after == (0, 2, 1, 3)
    old, new = roles(PP2_DP2, before), roles(PP2_DP2, after)
    assert [(r.stage, r.dp) for r in old] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [(r.stage, r.dp) for r in new] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert transfers(PP2_DP2, before, after) == (
        Transfer(src=2, dst=1, role=Role(2, 1, 0, 0)), Transfer(src=1, dst=2, role=Role(1, 0, 1, 0)))
    g = group_members(PP2_DP2, after)
    assert g["pp"] == ((0, 1), (2, 3))  # pipeline of DP group 0 is processes 0 then 1
    assert g["dp"] == ((0, 2), (1, 3))  # stage 0 on processes 0 and 2
    assert g["tp"] == ((0,), (2,), (1,), (3,))


def test_consolidation_moves_the_state_of_both_cells_it_touches() -> None:
    plan = plan_consolidation(PP2_DP2, {1: 1.5, 2: 1.5}, microbatches=2)
    after = layout(PP2_DP2, plan.gpu_of_rank)
    new = roles(PP2_DP2, after)
    assert {new[1].stage, new[2].stage} == {0}  # both stragglers in one stage
    moves = transfers(PP2_DP2, layout(PP2_DP2, None), after)
    assert sorted((m.src, m.dst) for m in moves) == sorted(
        (int(a), int(b)) for a, b in [plan.swaps[0], plan.swaps[0][::-1]])


def test_a_move_within_a_stage_keeps_the_replicas_state_unless_the_optimizer_is_sharded() -> None:
    after = (1, 0, 2, 3)  # processes 0 and 1 exchange DP groups of stage 0
    assert transfers(PP2_DP2, layout(PP2_DP2, None), after) == ()
    sharded = transfers(PP2_DP2, layout(PP2_DP2, None), after, replicated_dp=False)
    assert [(m.src, m.dst) for m in sharded] == [(1, 0), (0, 1)]


def test_a_cycle_of_three_moves_every_state_once() -> None:
    shape = ParallelShape(tp=1, dp=1, pp=3)
    moves = transfers(shape, (0, 1, 2), (1, 2, 0))  # rank 0 to process 1, 1 to 2, 2 to 0
    assert sorted((m.src, m.dst, m.role.rank) for m in moves) == [(0, 1, 0), (1, 2, 1), (2, 0, 2)]


def test_layouts_torch_cannot_keep_are_refused_with_the_reason() -> None:
    shape = ParallelShape(tp=2, dp=1, pp=2)
    with pytest.raises(LayoutError, match="permutation"):
        layout(shape, [0, 0, 1, 2])
    with pytest.raises(LayoutError, match="permutation"):
        layout(shape, [0, 1, 2])
    check_group_order(shape, (2, 3, 0, 1))  # whole TP groups exchanged: fine
    with pytest.raises(LayoutError, match=r"TP group on processes \[1, 0\]"):
        check_group_order(shape, (1, 0, 2, 3))
    dp = ParallelShape(tp=1, dp=2, pp=1)
    check_group_order(dp, (1, 0))  # DP order matters only to a sharded optimizer
    with pytest.raises(LayoutError, match="DP group"):
        check_group_order(dp, (1, 0), kinds=("tp", "dp"))
