"""Live mode writes what the hook writes: read back by the agent's reader and collector."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from greyhound.agent.collector import Collector, RankIteration
from greyhound.hookabi import (
    BenchKind,
    BenchRequest,
    BenchState,
    CommState,
    Flag,
    Op,
    RingReader,
    list_rings,
)
from greyhound.sim.events import CommKind
from greyhound.sim.live import LiveSimulation
from greyhound.sim.model import ClusterModel
from greyhound.sim.records import comm_kind
from greyhound.sim.scenario import Scenario
from tests.sim.helpers import job, scenario

J = job(tp=2, dp=2, pp=2, gpus_per_node=4, microbatches=4, microbatch_compute_s=0.05,
        dp_allreduce_bytes=1e8, pp_activation_bytes=1e6, optimizer_s=0.01,
        link_latency_us=5.0, nvlink_latency_us=1.0)


def drain_all(sim: LiveSimulation, readers: list[RingReader]) -> list[np.ndarray]:
    got: list[list[np.ndarray]] = [[] for _ in readers]
    while not sim.done:
        if not sim.step():
            for i, rd in enumerate(readers):
                got[i].append(rd.poll())
    for i, rd in enumerate(readers):
        got[i].append(rd.poll())
    return [np.concatenate(g) for g in got]


def model_durations(sc: Scenario) -> tuple[np.ndarray, np.ndarray]:
    m, t, starts, durs = ClusterModel(sc), 0.0, [], []
    while t < sc.duration_s:
        it = m.iteration(t, events=False)
        starts.append(t)
        durs.append(it.duration_s)
        t = it.end_s
    return np.array(starts), np.array(durs)


def test_rings_read_back_with_header_counters_and_order(tmp_path: Path) -> None:
    sc = scenario(J, duration_s=3.0)
    sim = LiveSimulation(sc, tmp_path, "job-a", capacity=1024)
    try:
        readers = [RingReader(p) for p in list_rings(tmp_path, "job-a")]
        assert [rd.header.rank for rd in readers] == list(range(8))
        recs = drain_all(sim, readers)
        h = readers[5].header
        assert (h.job, h.host, h.device) == ("job-a", "sim-node1", 1)
        # Wall = start + virtual seconds, through the anchors the agent uses.
        assert h.to_wall_ns(sim.mono0_ns + 2_000_000_000) == sim.wall0_ns + 2_000_000_000
        for rd, rec in zip(readers, recs, strict=True):
            assert len(rec) > 50 and rd.lost == 0
            assert np.all(np.diff(rec["enter_ns"].astype(np.int64)) >= 0)  # enter order
            assert np.all(rec["return_ns"] >= rec["enter_ns"])
            assert set(np.unique(rec["op"])) == {Op.ALLREDUCE, Op.SEND, Op.RECV}
            assert np.all(rec["datatype"] == 9)
            comms = rd.comms()
            assert len(comms) == 3 and np.all(comms["state"] == CommState.ACTIVE)
            for c in comms:
                mine = rec[rec["comm_id"] == c["comm_id"]]
                inside = int(c["inflight_enter_ns"] != 0)  # a call in progress at the end
                assert c["calls_completed"] == len(mine) == c["calls_entered"] - inside
                if comm_kind(int(c["comm_id"])) is CommKind.PP:
                    for op, field in ((Op.SEND, "send_count"), (Op.RECV, "recv_count")):
                        n = int((mine["op"] == op).sum())
                        assert int(c[field].sum()) == n
                        assert np.array_equal(mine["seq"][mine["op"] == op], np.arange(1, n + 1))
                else:  # collectives: seq 1, 2, 3, ... per communicator
                    assert np.array_equal(mine["seq"], np.arange(1, len(mine) + 1))
                    assert c["last_seq_completed"] == len(mine) == c["last_seq_entered"] - inside
        # Matching sends and receives carry the same per-pair number and completion time.
        r0, r4 = recs[0], recs[4]  # stage 0 and stage 1 of the same (dp, tp)
        s = r0[r0["op"] == Op.SEND]
        r = r4[r4["op"] == Op.RECV]
        n = min(len(s), len(r))
        assert n > 10 and np.array_equal(s["seq"][:n], r["seq"][:n])
        assert np.array_equal(s["return_ns"][:n], r["return_ns"][:n])
    finally:
        sim.close()


def test_collector_iteration_times_match_the_model(tmp_path: Path) -> None:
    faults = [{"kind": "gpu_slow", "rank": 3, "start_s": 8.0, "factor": 1.5}]
    sc = scenario(J, faults, duration_s=16.0)
    sim = LiveSimulation(sc, tmp_path, "job-b", capacity=1024)
    col = Collector(tmp_path, "job-b")
    try:
        col.scan()
        its: list[RankIteration] = []
        while not sim.done:
            if not sim.step():
                its += col.drain()
        its += col.drain()
    finally:
        col.close()
        sim.close()
    starts, durs = model_durations(sc)
    assert {i.rank for i in its} == set(range(8))
    checked = 0
    for it in its:
        v_end = (it.end_wall_ns - sim.wall0_ns) / 1e9
        k = int(np.searchsorted(starts, v_end, side="right")) - 1
        if k < 1 or durs[k] != durs[k - 1]:
            continue  # the two anchors sit at different offsets: the fault's onset
        assert it.duration_s == pytest.approx(durs[k - 1], rel=0.01)
        checked += 1
    assert checked > 0.9 * len(its) > 500
    slow = [i.duration_s for i in its if (i.end_wall_ns - sim.wall0_ns) / 1e9 > 9.0]
    assert durs[-1] > 1.15 * durs[0]
    assert min(slow) == pytest.approx(durs[-1], rel=0.01)


@pytest.mark.parametrize("kind", ["hang_hardware", "hang_not_entered"])
def test_hangs_show_in_the_comm_table_only(tmp_path: Path, kind: str) -> None:
    sc = scenario(J, [{"kind": kind, "rank": 1, "start_s": 1.0}], duration_s=3.0)
    sim = LiveSimulation(sc, tmp_path, "job-h", capacity=1024)
    try:
        readers = [RingReader(p) for p in list_rings(tmp_path, "job-h")]
        recs = drain_all(sim, readers)
        assert sim.progress().hung
        victim = readers[1].comms()
        busy = victim[victim["inflight_enter_ns"] != 0]
        if kind == "hang_hardware":  # entered, never returns
            assert len(busy) == 1
            assert busy["calls_entered"][0] == busy["calls_completed"][0] + 1
            if "last_count" in (busy.dtype.names or ()):  # layout v2: what it entered
                assert busy["last_count"][0] > 0 and busy["last_dtype"][0] == 9
        else:  # never entered: no counter moved, while its peers wait inside
            assert len(busy) == 0
            assert np.all(victim["calls_entered"] == victim["calls_completed"])
            waiting = [rd.comms() for rd in (readers[0],)]
            assert any(np.any(w["calls_entered"] > w["calls_completed"]) for w in waiting)
        # No record after the hang: the last one returned before the victim's stuck call.
        assert int(recs[1]["return_ns"].max()) < sim.mono0_ns + 1.6e9
    finally:
        sim.close()


def test_pause_bench_and_resume(tmp_path: Path) -> None:
    faults = [{"kind": "gpu_slow", "rank": 6, "start_s": 0.0, "factor": 2.0},
              {"kind": "link_congestion", "nodes": [0, 1], "start_s": 0.0, "factor": 4.0}]
    sc = scenario(J, faults, duration_s=6.0)
    # No reader drains here: only the ring capacity may hold the run back, not unread time.
    sim = LiveSimulation(sc, tmp_path, "job-p", capacity=1024, speed=20.0, tick_s=0.0,
                         max_ahead_s=float("inf"))
    try:
        readers = [RingReader(p) for p in list_rings(tmp_path, "job-p")]
        ctls = [rd.control() for rd in readers]
        while sim.virtual_s < 1.0:
            sim.step()
        for c in ctls:
            c.set_mode("profile")
            c.pause()
        for _ in range(200):
            sim.step()
            if all(c.paused() for c in ctls):
                break
        assert all(c.paused() for c in ctls)
        head = [rd.refresh_header().head for rd in readers]
        gemm = {r: ctls[r].submit(BenchRequest(BenchKind.GEMM, 8192, repeat=3)) for r in (2, 6)}
        pp_comm = int(readers[2].comms()["comm_id"][2])
        send = ctls[2].submit(BenchRequest(BenchKind.SEND, 1 << 26, comm_id=pp_comm, peer=1))
        bad = ctls[2].submit(BenchRequest(BenchKind.SEND, 1 << 26, comm_id=pp_comm, peer=0))
        for _ in range(5):
            sim.step()
        assert [rd.refresh_header().head for rd in readers] == head  # nothing moves
        g2, g6 = (ctls[r].result(gemm[r]) for r in (2, 6))
        assert g2 is not None and g6 is not None and g2.ok and len(g6.durations_ns) == 3
        assert g6.durations_ns[0] == pytest.approx(2 * g2.durations_ns[0], rel=1e-6)
        res = ctls[2].result(send)
        assert res is not None and res.ok  # rank 2 (node 0) -> rank 6 (node 1): congested
        expect = 5e-6 + (1 << 26) / (400e9 / 8 / 4)
        assert res.durations_ns[0] == pytest.approx(expect * 1e9, rel=1e-6)
        failed = ctls[2].result(bad)
        assert failed is not None and failed.state == BenchState.FAILED
        for c in ctls:
            c.resume()
        recs = drain_all(sim, readers)
        assert not any(c.paused() for c in ctls)
        want = Flag.PROFILED | Flag.GPU_DONE
        for r in recs:  # still in call order, and profiled from the pause on
            assert np.all(np.diff(r["enter_ns"].astype(np.int64)) >= 0)
            assert np.all(r["return_ns"] >= r["enter_ns"])
            after = r[r["enter_ns"] > np.uint64(sim.mono0_ns + 1.5e9)]
            assert len(after) > 20 and np.all(after["flags"] & want == want)
            assert np.array_equal(after["gpu_end_ns"], after["return_ns"])
        for c in ctls:
            c.close()
    finally:
        sim.close()


def test_never_runs_ahead_of_the_consumer(tmp_path: Path) -> None:
    sim = LiveSimulation(scenario(J, duration_s=100.0), tmp_path, "job-c", capacity=256,
                         lead=0.5)
    try:
        moved = [sim.step() for _ in range(200)]
        assert not moved[-1] and sim.virtual_s < 100.0
        assert max(r.lag() for r in sim.rings) <= 128 + 64
        assert sum(r.dropped for r in sim.rings) == 0
    finally:
        sim.close()


def test_held_back_or_finished_runs_do_not_look_hung(tmp_path: Path) -> None:
    """Held back by a reader that does not consume, the virtual clock stands still, so a call
    inside NCCL must not show wall-clock time passing there; once the run ends nothing is inside
    NCCL. Otherwise the tracker would see hangs that the simulated job does not have."""
    import time as _time

    sim = LiveSimulation(scenario(J, duration_s=20.0), tmp_path, "job-d", capacity=256, lead=0.5)
    col = Collector(tmp_path, "job-d")
    col.scan()
    try:
        while sim.step():
            pass
        assert not sim.done  # held back: the collector has not drained anything
        _time.sleep(0.3)
        sim.step()
        waits = col.counters(_time.monotonic_ns()).inflight_s
        assert max(waits) < 0.25, waits
        while not sim.done:
            if not sim.step():
                col.drain()
        sim.run()  # returns at once (done) and marks the job finished
        assert max(col.counters(_time.monotonic_ns()).inflight_s) == 0.0
    finally:
        sim.close()


def test_unread_virtual_time_stays_under_max_ahead(tmp_path: Path) -> None:
    """What the agent reads is never much older than the simulated present, as with a real
    agent draining every few tens of ms: profiling must not see calls from before a fault."""
    sim = LiveSimulation(scenario(J, duration_s=60.0), tmp_path, "job-e", max_ahead_s=1.0)
    readers = [RingReader(p) for p in list_rings(tmp_path, "job-e")]
    try:
        while sim.step():
            pass
        first_stop = sim.virtual_s
        assert 1.0 <= first_stop < 2.5  # one step past the limit at most
        for rd in readers:
            rd.poll()
        assert sim.step() and sim.virtual_s > first_stop
    finally:
        sim.close()
