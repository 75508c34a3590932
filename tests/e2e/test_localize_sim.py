"""Localisation end to end with the live simulator (TP2 DP4 PP2, 4 GPUs a node): a throttled
GPU is a compute straggler named by rank; a congested link between nodes 0 and 1 slows the two
stage-0 DP all-reduces, named as communicators, with the link as the one node pair both cross."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from greyhound.sim.live import LiveSimulation
from greyhound.sim.scenario import parse_scenario
from stack.up import Stack
from tests.e2e.conftest import incidents

JOB = {"tp": 2, "dp": 4, "pp": 2, "gpus_per_node": 4, "microbatches": 4,
       "microbatch_compute_s": 0.02, "dp_allreduce_bytes": 2.0e8, "pp_activation_bytes": 1.0e7,
       "link_gbps": 100, "nvlink_gbps": 900}


def _localized(stack: Stack, job: str) -> dict[str, Any] | None:
    for row in incidents(stack, job):
        if row["kind"].endswith("_slow"):
            return row
    return None


@pytest.mark.parametrize(("fault", "kind"), [
    ({"kind": "gpu_slow", "rank": 5, "factor": 1.5}, "compute_slow"),
    ({"kind": "link_congestion", "nodes": [0, 1], "factor": 4.0}, "comm_slow"),
])
def test_sim_fault_is_localized(stack: Stack, fault: dict[str, Any], kind: str) -> None:
    scenario = parse_scenario({
        "name": "loc", "job": JOB, "duration_s": 600, "seed": 5, "noise": {"jitter_cv": 0.01},
        "faults": [{**fault, "start_s": 25, "duration_s": 500}]})
    job = f"simloc-{uuid.uuid4().hex[:6]}"
    sim = LiveSimulation(scenario, stack.settings.shm_dir, job, speed=20.0)
    found: list[dict[str, Any]] = []
    next_poll = [0.0]

    def should_stop() -> bool:
        assert not stack.dead(), f"services died: {stack.dead()}"
        if time.monotonic() >= next_poll[0]:
            next_poll[0] = time.monotonic() + 0.5
            row = _localized(stack, job)
            if row is not None:
                found.append(row)
        return bool(found)

    try:
        sim.run(should_stop=should_stop)
    finally:
        sim.close(remove=True)
    assert found, f"not localized: {[(i['kind'], i['timeline']) for i in incidents(stack, job)]}"
    incident = found[0]
    culprit = incident["culprit"]
    assert incident["kind"] == kind, incident
    if kind == "compute_slow":
        assert culprit["compute_ranks"] == [5], culprit
        assert culprit["nodes"] == [1], culprit
    else:
        # the stage-0 DP rings (ranks 0,2,4,6 and 1,3,5,7) are the ones through nodes 0-1
        assert culprit["ranks"] == list(range(8)), culprit
        assert len(culprit["comm_ids"]) == 2, culprit
        assert culprit["links"] == [[0, 1]], culprit
