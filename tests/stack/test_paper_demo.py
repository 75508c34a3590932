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
