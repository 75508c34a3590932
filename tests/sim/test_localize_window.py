"""The analyzer's localisation core on a profiling window taken from the live simulator (no
services): a whole node under host contention and a single slow GPU are both named."""

from __future__ import annotations

from pathlib import Path

import pytest

from greyhound.core.slow_localization import localize_slow
from greyhound.hookabi import RingReader, list_rings
from greyhound.sim.live import LiveSimulation
from greyhound.sim.scenario import load_scenario
from services.agent.collector import Collector
from services.analyzer.profiling import ProfileBuffer
from services.common.bus.contract import CollectiveBatch

SUITE = Path(__file__).resolve().parents[2] / "scenarios" / "suite"


@pytest.mark.parametrize(("name", "before", "after", "ranks", "nodes"), [
    ("cpu-contention-s16-n1", 0.098, 0.114, [4, 5, 6, 7], [1]),
    ("gpu-slow-s16-r5", 0.098, 0.116, [5], [1]),
])
def test_profiled_window_names_the_slow_ranks(tmp_path: Path, name: str, before: float,
                                              after: float, ranks: list[int],
                                              nodes: list[int]) -> None:
    sc = load_scenario(SUITE / f"{name}.yaml")
    sim = LiveSimulation(sc, tmp_path, "win", speed=None)
    col = Collector(tmp_path, "win")
    col.scan()
    try:
        start = sc.faults[0].start_s
        while sim.virtual_s < start + 5:
            if not sim.step():
                col.drain()
        col.drain()
        for path in list_rings(tmp_path, "win"):
            RingReader(path).control().set_mode("profile")
        for stream in col.streams.values():
            stream.keep_records = True
        end = sim.virtual_s + 3
        while sim.virtual_s < end:
            if not sim.step():
                col.drain()
        col.drain()
        rows = col.take_profiled()
    finally:
        sim.close()
    buf = ProfileBuffer("win", frozenset(range(sc.job.world)))
    buf.opened_ts = 0.0
    buf.add(CollectiveBatch(job_id="win", agent_id="a", **vars(rows)))
    node_of = {r: r // sc.job.gpus_per_node for r in range(sc.job.world)}
    loc = localize_slow(buf.calls(), node_of_rank=node_of, before_s=before, after_s=after)
    assert loc.kind == "compute_slow", loc.evidence
    assert loc.compute_ranks == ranks and loc.nodes == nodes
