"""scripts/paper_oracle.py, the ceiling docs/mitigation.md quotes for the demo's "with" run: an
oracle that mitigates sooner does better, never better than the healthy job, and S3 is what a
link congestion needs."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from greyhound.sim.scenario import load_scenario
from greyhound.sim.throughput import offline_iterations, per_minute

ROOT = Path(__file__).resolve().parents[2]


def _oracle() -> ModuleType:
    spec = importlib.util.spec_from_file_location("paper_oracle", ROOT / "scripts" /
                                                  "paper_oracle.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_oracle_bounds_the_with_run_on_the_small_paper_job() -> None:
    sc = load_scenario(ROOT / "scenarios" / "paper-16.yaml")  # a GPU x3, then a link x8
    oracle = _oracle()

    def rate(**kw: float | bool) -> float:
        return per_minute(oracle.oracle_iterations(sc, **kw), sc.duration_s)

    healthy = per_minute(offline_iterations(sc, faults=False), sc.duration_s)
    without = per_minute(offline_iterations(sc), sc.duration_s)
    at_once, later = rate(delay_s=0.0, late_s=0.0), rate(delay_s=30.0, late_s=0.0)
    assert without < later < at_once <= healthy
    assert rate(delay_s=0.0, late_s=0.0, s3=False) < at_once
