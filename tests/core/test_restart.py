"""S4: the parts a restart should replace and its estimated cost; nothing is restarted."""

from __future__ import annotations

import pytest

from greyhound.core.plans import RestartPlan
from greyhound.core.restart import Culprit, RestartCosts, recommend_restart
from greyhound.core.verdict import ValidationVerdict
from tests.sim.helpers import iteration_s, job

COSTS = RestartCosts(checkpoint_bytes=400e9, write_bytes_per_s=2e9, read_bytes_per_s=4e9,
                     restart_overhead_s=300.0)


def test_slow_gpu_is_replaced_and_priced() -> None:
    culprit = Culprit.from_verdict(ValidationVerdict("compute_slow", gpus=[11], links=[]))
    rec = recommend_restart(culprit, COSTS, gpus_per_node=8)
    assert rec.replace_gpus == (11,) and rec.replace_nodes == () and rec.fallback_nodes == (1,)
    assert (rec.write_s, rec.read_s, rec.overhead_s) == (200.0, 100.0, 300.0)
    assert rec.cost_s == 600.0
    assert "GPU 11 (node 1)" in rec.summary and "600 s" in rec.summary


def test_links_leave_the_node_they_share() -> None:
    culprit = Culprit.from_verdict(
        ValidationVerdict("comm_slow", gpus=[], links=[(3, 1), (1, 5), (6, 7)]))
    rec = recommend_restart(culprit, COSTS, gpus_per_node=8)
    assert culprit.links == ((1, 3), (1, 5), (6, 7))
    assert rec.replace_nodes == (1, 6)  # node 1 covers two links; 6-7 tie goes to the lower id
    assert rec.replace_gpus == ()


def test_without_a_fresh_checkpoint_the_work_since_the_last_one_is_redone() -> None:
    costs = RestartCosts(400e9, 2e9, 4e9, 300.0, save_first=False, work_since_checkpoint_s=900.0)
    rec = recommend_restart(Culprit(gpus=(0,)), costs, gpus_per_node=8)
    assert rec.write_s == 0.0 and rec.redo_s == 900.0 and rec.cost_s == 1300.0


def test_recommended_parts_remove_the_fault_in_the_simulator() -> None:
    j = job(dp=4, microbatches=8, gpus_per_node=2, host_fraction=0.0)
    fault = [{"kind": "gpu_slow", "rank": 3, "start_s": 0, "factor": 1.5}]
    rec = recommend_restart(Culprit(gpus=(3,)), COSTS, gpus_per_node=2)
    plan = RestartPlan(replace_gpus=rec.replace_gpus, replace_nodes=rec.replace_nodes)
    assert iteration_s(j, fault) > iteration_s(j)
    assert iteration_s(j, fault, plan) == pytest.approx(iteration_s(j))


def test_nothing_to_replace_is_an_error() -> None:
    with pytest.raises(ValueError, match="transient"):
        Culprit.from_verdict(ValidationVerdict("transient", gpus=[], links=[]))
    with pytest.raises(ValueError, match="nothing to replace"):
        recommend_restart(Culprit(), COSTS, gpus_per_node=8)
    with pytest.raises(ValueError, match="read_bytes_per_s"):
        RestartCosts(1.0, 1.0, 0.0, 1.0)
