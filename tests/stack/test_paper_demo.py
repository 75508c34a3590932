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
