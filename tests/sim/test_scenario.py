"""Scenario validation: every bad input names its field."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from greyhound.sim.model import ClusterModel
from greyhound.sim.scenario import NoiseSpec, ScenarioError, load_scenario, parse_scenario
from tests.sim.helpers import job

ROOT = Path(__file__).resolve().parents[2]


def data(**kw: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"job": job(tp=2, dp=2, pp=2, gpus_per_node=4), "duration_s": 10}
    d.update(kw)
    return d


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (data(faults=[{"kind": "gpu_melt", "rank": 1}]), "faults[0].kind"),
        (data(faults=[{"kind": "gpu_slow", "rank": 8, "factor": 2}]), "faults[0].rank"),
        (data(faults=[{"kind": "gpu_slow", "rank": "3", "factor": 2}]), "faults[0].rank"),
        (data(faults=[{"kind": "gpu_slow", "rank": 1}]), "faults[0].factor"),
        (data(faults=[{"kind": "cpu_contention", "node": 2, "factor": 2}]), "faults[0].node"),
        (data(faults=[{"kind": "link_congestion", "nodes": [1, 1], "factor": 2}]),
         "faults[0].nodes"),
        (data(faults=[{"kind": "hang_hardware", "rank": 1, "start_s": 1},
                      {"kind": "hang_not_entered", "rank": 2, "start_s": 5}]), "faults[1].start_s"),
        (data(faults=[{"kind": "gpu_slow", "rank": 1, "factor": 2, "nodes": [0, 1]}]),
         "faults[0].nodes"),
        (data(duration_s="long"), "duration_s"),
        (data(seed=True), "seed"),
        (data(job={**job(), "tp": 0}), "job.tp"),
        (data(job={k: v for k, v in job().items() if k != "link_gbps"}), "job.link_gbps"),
        (data(job={**job(), "tpp": 2}), "job.tpp"),
        (data(noise={"gc_prob": 2.0}), "noise.gc_prob"),
        (data(colour="red"), "colour"),
    ],
)
def test_invalid_scenarios_name_the_field(bad: dict[str, Any], field: str) -> None:
    with pytest.raises(ScenarioError) as err:
        parse_scenario(bad)
    assert err.value.field == field
    assert str(err.value).startswith(field + ":")


def test_sequential_hangs_are_allowed() -> None:
    faults = [{"kind": "hang_hardware", "rank": 1, "start_s": 1, "duration_s": 2},
              {"kind": "hang_not_entered", "rank": 2, "start_s": 5}]
    assert len(parse_scenario(data(faults=faults)).faults) == 2


@pytest.mark.parametrize("path", sorted((ROOT / "scenarios").glob("*.yaml")), ids=lambda p: p.stem)
def test_example_scenarios_load(path: Path) -> None:
    s = load_scenario(path)
    assert s.name and s.job.world > 0 and s.duration_s > 0


CONTENDED = sorted(p for p in (ROOT / "scenarios").rglob("*.yaml")
                   if "cpu_contention" in p.read_text())


@pytest.mark.parametrize("path", CONTENDED, ids=lambda p: p.stem)
def test_cpu_contention_in_the_scenarios_puts_hosts_behind_their_gpus(path: Path) -> None:
    """Host contention slows a job only once its hosts need longer than their GPUs: every
    scenario's contention must do so (the suite's strongly: its kind must be localisable)."""
    s = load_scenario(path)
    quiet = NoiseSpec(jitter_cv=0.0, gc_prob=0.0)
    healthy = ClusterModel(replace(s, faults=(), noise=quiet)).iteration(0.0, events=False)
    for f in s.faults:
        if f.kind != "cpu_contention":
            continue
        always = replace(f, start_s=0.0, duration_s=None)
        slow = ClusterModel(replace(s, faults=(always,), noise=quiet)).iteration(0.0, events=False)
        ratio = slow.duration_s / healthy.duration_s
        assert ratio > (1.15 if path.parent.name == "suite" else 1.01), ratio
