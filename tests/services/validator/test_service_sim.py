"""The validator against the simulator: the simulated ranks answer the same control blocks as
the hook, so a throttled GPU and a congested inter-node link are found on the paused job."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from greyhound.sim.live import LiveSimulation
from services.common.bus.contract import Suspicion
from services.validator.settings import ValidatorSettings
from tests.services.validator.conftest import MiniStack
from tests.sim.helpers import job, scenario

WORLD = 4


@pytest.fixture()
def validator_config() -> ValidatorSettings:
    return ValidatorSettings()  # the defaults: N = 2048, 16/32/64 MB, 3x each (virtual time)


async def test_gpu_slow_and_link_congestion_in_the_simulator(mini_stack: MiniStack,
                                                             tmp_path: Path) -> None:
    j = job(tp=1, dp=WORLD, pp=1, gpus_per_node=1, microbatches=4, microbatch_compute_s=0.05,
            dp_allreduce_bytes=1e8, optimizer_s=0.01, link_gbps=100, link_latency_us=5.0)
    sc = scenario(j, [{"kind": "gpu_slow", "rank": 2, "start_s": 0.0, "factor": 2.0},
                      {"kind": "link_congestion", "nodes": [1, 2], "start_s": 0.0,
                       "factor": 4.0}],
                  duration_s=600.0, name="validator-sim",
                  noise={"jitter_cv": 0.01, "gc_prob": 0.0})
    sim = LiveSimulation(sc, Path(mini_stack.settings.shm_dir), "valsim")
    done = threading.Event()
    runner = threading.Thread(target=sim.run, kwargs={"should_stop": done.is_set}, daemon=True)
    runner.start()
    try:
        await mini_stack.wait_ranks("valsim", WORLD)
        incident_id = await mini_stack.open_incident("valsim")
        inc = await mini_stack.suspect(Suspicion(
            job_id="valsim", incident_id=incident_id, kind="mixed_slow", ranks=[2], comm_ids=[]))
        v0 = sim.virtual_s
        await asyncio.sleep(0.5)
        assert sim.virtual_s > v0 and not sim._parked  # resumed: the clock and ranks move on
    finally:
        done.set()
        await asyncio.to_thread(runner.join, 30)
        sim.close(remove=True)
    run = mini_stack.validator.runs[-1]
    assert run.verdict is not None, run.failure
    v = inc.evidence.validation
    assert inc.kind == "mixed_slow" and v is not None, v
    assert inc.culprit.as_json()["gpus"] == [
        {"rank": 2, "node": 2, "host": "sim-node2", "device": 0}]
    assert inc.culprit.links == [(1, 2)] and inc.culprit.nodes == [1, 2]
    assert (v.pause_s or 0) <= 5.0
