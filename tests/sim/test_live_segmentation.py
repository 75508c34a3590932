"""The agent's iteration times over a live pipeline job, before, under and after a micro-batch
plan: every rank, every stage, the model's own iterations.

A later pipeline stage calls one receive and one send per micro-batch and a single all-reduce
per iteration, so a fraction of its period agrees with itself at better than 0.95, and, once a
plan has given it one micro-batch and taken it back, its receive recurs within an iteration.
Either way its agent used to cut each iteration into micro-batch pieces (4 ms, 4 ms, 4 ms,
232 ms over and over in a 64-GPU job), which the tracker read as slowdowns and recoveries of
half the job."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from greyhound.core.plans import MicrobatchPlan
from greyhound.sim.live import LiveSimulation
from services.agent.collector import Collector, RankIteration
from tests.sim.helpers import job, scenario

J = job(tp=1, dp=2, pp=2, gpus_per_node=4, microbatches=16, microbatch_compute_s=0.01,
        dp_allreduce_bytes=1e6, pp_activation_bytes=1e5, optimizer_s=0.005)


def _run(sim: LiveSimulation, col: Collector, until_s: float) -> list[RankIteration]:
    its: list[RankIteration] = []
    while sim.virtual_s < until_s and not sim.done:
        if not sim.step():
            col.scan()
            its += col.drain()
    return its


def test_every_stage_measures_whole_iterations_through_a_plan_and_its_revert(
        tmp_path: Path) -> None:
    sc = scenario(J, duration_s=40.0, costs={"microbatch_s": 0.0, "reconfigure_s": 0.0})
    sim = LiveSimulation(sc, tmp_path, "job-seg", speed=None)
    col = Collector(tmp_path, "job-seg")
    try:
        its = _run(sim, col, 12.0)
        sim.submit(1, [MicrobatchPlan((15, 1))])
        its += _run(sim, col, 24.0)
        sim.submit(2, [MicrobatchPlan((8, 8))])
        its += _run(sim, col, 40.0)
        its += col.drain()
        times = sim.iteration_times()
    finally:
        col.close()
        sim.close(remove=True)
    starts = np.array([s for s, _ in times])
    durs = np.array([d for _, d in times])
    assert {i.rank for i in its} == {0, 1, 2, 3}
    for rank in range(4):
        mine = [i for i in its if i.rank == rank]
        ends = np.array([(i.end_wall_ns - sim.wall0_ns) / 1e9 for i in mine])
        got = np.array([i.duration_s for i in mine])
        # every iteration the agent reports is one of the model's, within 2%
        k = np.searchsorted(starts, ends, side="right") - 2
        ok = k >= 0
        assert ok.sum() > 0.8 * len(durs), f"rank {rank}: {ok.sum()} of {len(durs)} iterations"
        err = np.abs(got[ok] - durs[k[ok]]) / durs[k[ok]]
        assert np.median(err) < 0.02, f"rank {rank}: median error {np.median(err):.1%}"
        assert got.min() > 0.5 * durs.min(), f"rank {rank}: a piece of an iteration, {got.min()}"
        # and it goes on measuring after the revert
        assert (ends > 30.0).sum() > 0.8 * (starts > 30.0).sum()
