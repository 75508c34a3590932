"""Plans in a live run: applied at the next iteration not simulated yet, after their modelled
cost (S2 cheap, S3 a pause), reported with it; a plan the job cannot apply is a failure report,
never a crash; a scenario follows plans only when it says so."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from greyhound.core.plans import MicrobatchPlan, SwapGpusPlan
from greyhound.hookabi import RingReader, list_rings
from greyhound.sim.live import LiveSimulation
from greyhound.sim.scenario import ScenarioError
from tests.sim.helpers import job, scenario

J = job(tp=1, dp=4, pp=1, gpus_per_node=4, microbatches=16, microbatch_compute_s=0.05,
        dp_allreduce_bytes=1e6, optimizer_s=0.01)


def _run_until(sim: LiveSimulation, readers: list[RingReader], virtual_s: float) -> None:
    while sim.virtual_s < virtual_s and not sim.done:
        if not sim.step():
            for rd in readers:
                rd.poll()


def test_plans_take_effect_at_a_boundary_after_their_cost(tmp_path: Path) -> None:
    sc = scenario(J, [{"kind": "gpu_slow", "rank": 1, "start_s": 0.0, "factor": 2.0}],
                  duration_s=60.0, costs={"microbatch_s": 0.5, "reconfigure_s": 5.0})
    sim = LiveSimulation(sc, tmp_path, "job-m", speed=None)
    try:
        readers = [RingReader(p) for p in list_rings(tmp_path, "job-m")]
        _run_until(sim, readers, 10.0)
        slow = np.median([d for _, d in sim.iteration_times()])
        sim.submit(1, [MicrobatchPlan((5, 3, 4, 4))])
        _run_until(sim, readers, 20.0)
        (s2,) = sim.applied()
        assert (s2.tag, s2.cost_s, s2.error) == (1, 0.5, None)
        times = sim.iteration_times()
        starts = np.array([s for s, _ in times])
        before = starts[starts < s2.virtual_s]
        # the plan's iteration starts half a second after the previous one ended
        assert s2.virtual_s == pytest.approx(before[-1] + times[len(before) - 1][1] + 0.5)
        after = [d for s, d in times if s >= s2.virtual_s]
        assert np.median(after) < 0.85 * slow  # GPU 1's group runs 3 micro-batches, not 4
        sim.submit(2, [SwapGpusPlan(((0, 1),))])
        sim.submit(3, [MicrobatchPlan((4, 4, 4))])  # three counts for four DP groups
        _run_until(sim, readers, 35.0)
        swap, bad = sim.applied()
        assert (swap.tag, swap.cost_s, swap.error) == (2, 5.0, None)
        assert bad.tag == 3 and bad.cost_s == 0.0 and bad.error is not None and "counts" in bad.error
        assert sim.model.layout.counts == (5, 3, 4, 4)  # the bad plan changed nothing
    finally:
        sim.close(remove=True)


def test_only_a_scenario_with_a_mitigation_section_follows_plans() -> None:
    assert not scenario(J).follows_plans
    assert scenario(J, mitigation={}).follows_plans
    off = scenario(J, mitigation={"follow_plans": False, "poll_s": 1.0})
    assert not off.follows_plans and off.mitigation is not None and off.mitigation.poll_s == 1.0
    with pytest.raises(ScenarioError, match=r"mitigation\.follow_plans"):
        scenario(J, mitigation={"follow_plans": "yes"})
    with pytest.raises(ScenarioError, match=r"mitigation\.speed"):
        scenario(J, mitigation={"speed": 2})
