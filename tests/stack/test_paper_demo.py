"""The paper demo's planner configuration: the scenario's costs start the planner's estimates."""

from __future__ import annotations

import io

import pytest

from greyhound.sim.scenario import load_scenario
from services.planner.settings import PlannerSettings
from stack.paper_demo import SCENARIO, planner_costs


def test_the_planners_estimates_are_the_scenarios_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GREYHOUND_PLANNER_S2_OVERHEAD_S", raising=False)
    monkeypatch.delenv("GREYHOUND_PLANNER_S3_OVERHEAD_S", raising=False)
    sc = load_scenario(SCENARIO)
    out = io.StringIO()
    got = planner_costs(sc, PlannerSettings(), out)
    assert (got.s2_overhead_s, got.s3_overhead_s) == (sc.costs.microbatch_s,
                                                       sc.costs.reconfigure_s) == (1.0, 30.0)
    assert "S2 1 s, S3 30 s" in out.getvalue()


def test_an_estimate_the_environment_sets_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GREYHOUND_PLANNER_S3_OVERHEAD_S", "90")
    monkeypatch.delenv("GREYHOUND_PLANNER_S2_OVERHEAD_S", raising=False)
    got = planner_costs(load_scenario(SCENARIO), PlannerSettings(), io.StringIO())
    assert (got.s2_overhead_s, got.s3_overhead_s) == (1.0, 90.0)


def _plan(incident: str, strategy: str, status: str) -> dict[str, object]:
    return {"incident_id": incident, "strategy": strategy, "status": status}


def test_a_fault_is_reacted_to_once_validated_and_its_plan_took_effect() -> None:
    """The pace stays at 1x after a validation while the planner decides (an S3 waits for its
    loss), so the planner's reading lag is not multiplied by the fast pace."""
    from greyhound.sim.score import Found
    from stack.paper_run import SETTLE_AFTER_NAMED_S, reacted

    sc = load_scenario(SCENARIO)  # fault 6: link 5-6 from 495 s
    link = Found(5, True, True, "l", detect_s=9.5, localize_s=16.3, validate_s=21.6)
    assert not reacted(sc, Found(5, False, False, detect_s=9.5), [], 600.0)  # not named
    assert not reacted(sc, link, [], 520.0)  # validated; the escalation counts its loss
    assert not reacted(sc, link, [_plan("l", "S3", "approved")], 530.0)  # on its way
    assert reacted(sc, link, [_plan("l", "S3", "applied")], 549.0)
    assert not reacted(sc, link, [_plan("other", "S3", "applied")], 549.0)
    named = Found(5, True, True, "l", detect_s=9.5, localize_s=16.3)  # never validated
    assert not reacted(sc, named, [], 495 + 16.3 + SETTLE_AFTER_NAMED_S - 1)
    assert reacted(sc, named, [], 495 + 16.3 + SETTLE_AFTER_NAMED_S + 1)


def test_an_ended_fault_is_held_while_its_s2_plan_is_in_force() -> None:
    from greyhound.sim.score import Found
    from stack.paper_run import held_at_end

    sc = load_scenario(SCENARIO)  # faults 1 and 2 (GPUs 21, 140) overlap: 20-120, 70-180
    both = [Found(0, True, True, "a"), Found(1, True, True, "a")]
    s2 = [_plan("a", "S2", "applied")]
    assert not held_at_end(sc, 0, both, s2, 121.0)  # fault 2 still needs the plan
    assert held_at_end(sc, 1, both, s2, 181.0)
    assert not held_at_end(sc, 1, both, [_plan("a", "S2", "reverted")], 181.0)
    assert not held_at_end(sc, 1, both, [_plan("a", "S3", "applied")], 181.0)  # no re-check
    assert not held_at_end(sc, 1, [Found(1, False, False)], s2, 181.0)  # never found
