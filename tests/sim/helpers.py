"""Small builders shared by the simulator tests."""

from __future__ import annotations

from typing import Any

from greyhound.sim.model import ClusterModel
from greyhound.sim.scenario import Scenario, parse_scenario

QUIET = {"jitter_cv": 0.0, "gc_prob": 0.0}


def job(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "tp": 1, "dp": 1, "pp": 1, "gpus_per_node": 8, "microbatches": 4,
        "microbatch_compute_s": 1.0, "dp_allreduce_bytes": 0, "pp_activation_bytes": 0,
        "link_gbps": 400, "nvlink_gbps": 3600, "optimizer_s": 0.0,
        "link_latency_us": 0.0, "nvlink_latency_us": 0.0,
    }
    base.update(overrides)
    return base


def scenario(j: dict[str, Any], faults: list[dict[str, Any]] | None = None, **kw: Any) -> Scenario:
    data: dict[str, Any] = {"job": j, "duration_s": 100.0, "noise": QUIET, "faults": faults or []}
    data.update(kw)
    return parse_scenario(data)


def iteration_s(j: dict[str, Any], faults: list[dict[str, Any]] | None = None, *plans: Any) -> float:
    model = ClusterModel(scenario(j, faults))
    for plan in plans:
        model.apply_plan(plan)
    return model.iteration(0.0, events=False).duration_s
