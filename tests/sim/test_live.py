"""Live mode writes what the hook writes over an asynchronous NCCL: read back by the agent's
reader and collector, and compared with the model the rings come from."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from greyhound.hookabi import (
    BenchKind,
    BenchRequest,
    BenchState,
    CommState,
    Control,
    Flag,
    Op,
    RingReader,
    list_rings,
)
from greyhound.sim.events import CommKind
from greyhound.sim.live import LiveSimulation
from greyhound.sim.model import ClusterModel
from greyhound.sim.records import RecordCodec, comm_kind
from greyhound.sim.scenario import Scenario
from services.agent.collector import Collector, RankIteration
from tests.sim.helpers import job, scenario

J = job(tp=2, dp=2, pp=2, gpus_per_node=4, microbatches=4, microbatch_compute_s=0.05,
        dp_allreduce_bytes=1e8, pp_activation_bytes=1e6, optimizer_s=0.01,
        link_latency_us=5.0, nvlink_latency_us=1.0)
TIMED = Flag.PROFILED | Flag.GPU_DONE


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


def model_records(sc: Scenario, mono0_ns: int, world: int) -> list[np.ndarray]:
    """Every rank's records as the model makes them (a twin of the live run's model)."""
    model, codec = ClusterModel(sc), RecordCodec(ClusterModel(sc).comms, mono0_ns, pid=0)
    t, ranks, recs = 0.0, [], []
    while t < sc.duration_s:
        it = model.iteration(t)
        r, rec = codec.encode(it.blocks)
        ranks.append(r)
        recs.append(rec)
        t = it.end_s
    rank, rec = np.concatenate(ranks), np.concatenate(recs)
    return [rec[rank == r] for r in range(world)]


def test_rings_read_back_with_header_counters_and_order(tmp_path: Path) -> None:
    sc = scenario(J, duration_s=3.0)
    sim = LiveSimulation(sc, tmp_path, "job-a", capacity=1024)
    try:
        readers = [RingReader(p) for p in list_rings(tmp_path, "job-a")]
        assert [rd.header.rank for rd in readers] == list(range(8))
        recs = drain_all(sim, readers)
        read_at = time.monotonic_ns()
        v_end_ns = sim.mono0_ns + round(sim.virtual_s * 1e9)
        h = readers[5].header
        assert (h.job, h.host, h.device) == ("job-a", "sim-node1", 1)
        # Wall = start + virtual seconds, through the anchors the agent uses.
        assert h.to_wall_ns(sim.mono0_ns + 2_000_000_000) == sim.wall0_ns + 2_000_000_000
        for rd, rec in zip(readers, recs, strict=True):
            assert len(rec) > 50 and rd.lost == 0
            assert np.all(np.diff(rec["enter_ns"].astype(np.int64)) > 0)  # enqueue order
            # Host time inside the API is the launch cost; monitor mode records no GPU times.
            assert np.all(rec["return_ns"] - rec["enter_ns"] == 5000)
            assert np.all(rec["flags"] == 0) and not rec["gpu_start_ns"].any()
            assert set(np.unique(rec["op"])) == {Op.ALLREDUCE, Op.SEND, Op.RECV}
            assert np.all(rec["datatype"] == 9)
            comms = rd.comms()
            assert len(comms) == 3 and np.all(comms["state"] == CommState.ACTIVE)
            assert np.all(comms["gpu_marks"] == 1) and not comms["inflight_enter_ns"].any()
            for c in comms:
                mine = rec[rec["comm_id"] == c["comm_id"]]
                assert c["calls_completed"] == len(mine) == c["calls_entered"]
                assert c["last_op"] == mine["op"][-1] and c["last_count"] == mine["count"][-1]
                done = int(c["gpu_calls_done"])
                assert 0 < done <= len(mine)
                if done < len(mine):  # the oldest call not done on the GPU is the pending one
                    p = mine[done]
                    assert (c["gpu_pending_op"], c["gpu_pending_count"],
                            c["gpu_pending_dtype"]) == (p["op"], p["count"], p["datatype"])
                    # aged against the reader's clock by the virtual time since its enqueue
                    age = (read_at - int(c["gpu_pending_ns"])) / 1e9
                    assert age == pytest.approx((v_end_ns - int(p["enter_ns"])) / 1e9, abs=0.5)
                else:
                    assert c["gpu_pending_ns"] == 0 == c["gpu_pending_op"]
                if comm_kind(int(c["comm_id"])) is CommKind.PP:
                    assert c["gpu_seq_done"] == 0 == c["gpu_pending_seq"]
                    for op, field in ((Op.SEND, "send_count"), (Op.RECV, "recv_count")):
                        n = int((mine["op"] == op).sum())
                        assert int(c[field].sum()) == n
                        assert np.array_equal(mine["seq"][mine["op"] == op], np.arange(1, n + 1))
                else:  # collectives: seq 1, 2, 3, ... per communicator
                    assert np.array_equal(mine["seq"], np.arange(1, len(mine) + 1))
                    assert c["last_seq_completed"] == len(mine) == c["last_seq_entered"]
                    assert c["gpu_seq_done"] == done
                    assert c["gpu_pending_seq"] in (0, done + 1)
    finally:
        sim.close()


def test_profiled_records_carry_the_models_two_timelines(tmp_path: Path) -> None:
    """Profile mode from the start: every record is the model's call, host times microseconds
    apart and ahead of the GPU times; a send and its receive complete together on the GPU; a
    throttled GPU's host enqueues exactly when its TP peer's does while its GPU arrives late."""
    faults = [{"kind": "gpu_slow", "rank": 3, "start_s": 0.0, "factor": 1.5}]
    sc = scenario(J, faults, duration_s=3.0)
    sim = LiveSimulation(sc, tmp_path, "job-g", capacity=1024)
    try:
        readers = [RingReader(p) for p in list_rings(tmp_path, "job-g")]
        for rd in readers:
            rd.control().set_mode("profile")
        recs = drain_all(sim, readers)
        twin = model_records(sc, sim.mono0_ns, 8)
        for rec, want in zip(recs, twin, strict=True):
            assert len(rec) > 50 and np.all(rec["flags"] & TIMED == TIMED)
            for f in ("enter_ns", "return_ns", "gpu_start_ns", "gpu_end_ns", "seq", "op"):
                assert np.array_equal(rec[f], want[f][: len(rec)]), f
            assert np.all(rec["gpu_start_ns"] >= rec["enter_ns"])
            # The host enqueues an iteration long before its GPU gets there.
            lead = (rec["gpu_start_ns"].astype(np.int64) - rec["enter_ns"].astype(np.int64))
            assert np.median(lead) > 0.01e9
        r0, r4 = recs[0], recs[4]  # stage 0 and stage 1 of the same (dp, tp)
        s = r0[r0["op"] == Op.SEND]
        r = r4[r4["op"] == Op.RECV]
        n = min(len(s), len(r))
        assert n > 10 and np.array_equal(s["seq"][:n], r["seq"][:n])
        assert np.array_equal(s["gpu_end_ns"][:n], r["gpu_end_ns"][:n])
        tp = [x[(x["op"] == Op.ALLREDUCE) & (comm_kind(int(x["comm_id"][0])) is CommKind.TP)
                & (x["comm_id"] == x["comm_id"][0])] for x in (recs[2], recs[3])]
        n = min(len(tp[0]), len(tp[1]))
        peer, slow = tp[0][:n], tp[1][:n]
        assert n > 20 and np.array_equal(peer["seq"], slow["seq"])
        assert np.array_equal(peer["enter_ns"], slow["enter_ns"])
        assert np.all(slow["gpu_start_ns"] > peer["gpu_start_ns"])
        assert np.array_equal(slow["gpu_end_ns"], peer["gpu_end_ns"])
    finally:
        sim.close()


def test_comm_tables_follow_the_host_ahead_of_the_gpu(tmp_path: Path) -> None:
    """At every tick the host counters lead: most of the time the host has enqueued its DP
    all-reduce while its GPU is still working towards it; the oldest pending call is the one
    right after the GPU's done ones, and a host is inside NCCL for microseconds at most."""
    sc = scenario(J, duration_s=3.0)
    # 2 s of wall time sampled every 10 ms: a few hundred DP rows when idle, about a hundred
    # on a loaded 2-core machine; 50 are plenty for the 60% share below.
    sim = LiveSimulation(sc, tmp_path, "job-t", capacity=1024, speed=1.5, tick_s=0.0,
                         max_ahead_s=float("inf"))
    try:
        readers = [RingReader(p) for p in list_rings(tmp_path, "job-t")]
        samples = ahead = 0
        deadline = time.monotonic() + 60
        while not sim.done and time.monotonic() < deadline:
            time.sleep(0.01)
            if not sim.step():
                continue
            for rd in readers:
                rd.poll()
                for c in rd.comms():
                    entered, done = int(c["calls_entered"]), int(c["gpu_calls_done"])
                    inside = entered - int(c["calls_completed"])
                    assert inside in (0, 1) and (c["inflight_enter_ns"] != 0) == (inside == 1)
                    assert done <= entered and (c["gpu_pending_op"] != 0) == (done < entered)
                    if comm_kind(int(c["comm_id"])) is CommKind.PP:
                        continue
                    assert int(c["gpu_seq_done"]) == done <= int(c["last_seq_entered"])
                    assert int(c["gpu_pending_seq"]) in (0, done + 1)
                    if comm_kind(int(c["comm_id"])) is CommKind.DP:
                        samples += 1
                        ahead += done < entered
        assert sim.done and samples > 50
        assert ahead > 0.6 * samples
    finally:
        sim.close()


def test_collector_iteration_times_match_the_model(tmp_path: Path) -> None:
    """Iteration periods stay host-side: the host synchronises once per iteration, so its
    enqueue times repeat with the GPU's iteration period."""
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


def members(readers: list[RingReader]) -> dict[int, dict[int, np.ndarray]]:
    """comm id -> {global rank: that rank's comm row}."""
    out: dict[int, dict[int, np.ndarray]] = {}
    for r, rd in enumerate(readers):
        for c in rd.comms():
            out.setdefault(int(c["comm_id"]), {})[r] = c
    return out


@pytest.mark.parametrize("kind", ["hang_hardware", "hang_not_entered", "hang_inconsistent"])
def test_a_hang_is_a_call_pending_on_the_gpu_with_every_host_outside_nccl(
        tmp_path: Path, kind: str) -> None:
    sc = scenario(J, [{"kind": kind, "rank": 1, "start_s": 1.0}], duration_s=4.0)
    sim = LiveSimulation(sc, tmp_path, "job-h", capacity=1024)
    try:
        readers = [RingReader(p) for p in list_rings(tmp_path, "job-h")]
        drain_all(sim, readers)
        assert sim.progress().hung
        now = time.monotonic_ns()
        groups = members(readers)
        rows = [row for g in groups.values() for row in g.values()]
        assert not any(int(row["inflight_enter_ns"]) for row in rows)
        assert all(row["calls_entered"] == row["calls_completed"] for row in rows)
        waits = [(now - int(row["gpu_pending_ns"])) / 1e9 for row in rows
                 if row["gpu_pending_ns"]]
        assert waits and max(waits) > 2.0  # pending since the hang, ~3 virtual seconds
        stuck = {cid: g for cid, g in groups.items()
                 if any(int(row["gpu_pending_seq"]) for row in g.values())}
        victim_rows = [g[1] for g in stuck.values() if 1 in g]
        if kind == "hang_not_entered":
            # Some peer waits at a seq the victim's host never enqueued; the victim has nothing
            # pending there.
            assert any(int(row["gpu_pending_seq"]) > int(g[1]["last_seq_entered"])
                       and g[1]["gpu_pending_op"] == 0
                       for g in stuck.values() if 1 in g for r, row in g.items() if r != 1)
        elif kind == "hang_inconsistent":
            # At one seq the victim's pending call is another op than its peers'.
            assert any(int(g[1]["gpu_pending_seq"]) == int(row["gpu_pending_seq"]) > 0
                       and g[1]["gpu_pending_op"] != row["gpu_pending_op"]
                       for g in stuck.values() if 1 in g for r, row in g.items() if r != 1)
        else:
            # Every member enqueued the victim's pending call (and ran past it on the host).
            assert any(all(int(row["last_seq_entered"]) >= int(v["gpu_pending_seq"])
                           for row in groups[int(v["comm_id"])].values())
                       for v in victim_rows if v["gpu_pending_seq"])
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
        paused_at = sim.mono0_ns + round(sim.virtual_s * 1e9)
        gemm = {r: ctls[r].submit(BenchRequest(BenchKind.GEMM, 8192, repeat=3)) for r in (2, 6)}
        pp_comm = int(readers[2].comms()["comm_id"][2])
        send = ctls[2].submit(BenchRequest(BenchKind.SEND, 1 << 26, comm_id=pp_comm, peer=1))
        bad = ctls[2].submit(BenchRequest(BenchKind.SEND, 1 << 26, comm_id=pp_comm, peer=0))
        deadline = time.monotonic() + 30
        failed = None
        while failed is None and time.monotonic() < deadline:
            sim.step()  # the benchmarks run once each rank's queued GPU work has drained
            time.sleep(0.001)
            failed = ctls[2].result(bad)
        assert failed is not None and failed.state == BenchState.FAILED
        g2, g6 = (ctls[r].result(gemm[r]) for r in (2, 6))
        assert g2 is not None and g6 is not None and g2.ok and len(g6.durations_ns) == 3
        assert g6.durations_ns[0] == pytest.approx(2 * g2.durations_ns[0], rel=1e-6)
        res = ctls[2].result(send)
        assert res is not None and res.ok  # rank 2 (node 0) -> rank 6 (node 1): congested
        expect = 5e-6 + (1 << 26) / (400e9 / 8 / 4)
        assert res.durations_ns[0] == pytest.approx(expect * 1e9, rel=1e-6)
        assert 0 <= res.drain_ns < 1e9 and 0 <= g2.drain_ns < 1e9
        resumed_at = sim.mono0_ns + round(sim.virtual_s * 1e9)
        for c in ctls:
            c.resume()
        recs = drain_all(sim, readers)
        assert not any(c.paused() for c in ctls)
        for r in recs:  # still in call order, and profiled from the pause on
            assert np.all(np.diff(r["enter_ns"].astype(np.int64)) > 0)
            assert np.all(r["return_ns"] >= r["enter_ns"])
            # parked hosts enqueued nothing while paused
            assert not np.any((r["enter_ns"] > paused_at) & (r["enter_ns"] < resumed_at))
            after = r[r["enter_ns"] > np.uint64(sim.mono0_ns + 1.5e9)]
            assert len(after) > 20 and np.all(after["flags"] & TIMED == TIMED)
            assert np.all(after["gpu_end_ns"] >= after["gpu_start_ns"])
            assert np.all(after["gpu_start_ns"] >= after["enter_ns"])
        for c in ctls:
            c.close()
    finally:
        sim.close()


def test_a_parked_rank_drains_its_gpu_while_its_peers_wait(tmp_path: Path) -> None:
    """Targeted at its next iteration's DP all-reduce, rank 0's host parks ~a tenth into that
    iteration; its GPU still runs the work queued before (the benchmark waits for it, drain_ns),
    its DP peer's GPU waits in the all-reduce rank 0 never enqueued, and no host is in NCCL."""
    sc = scenario(J, duration_s=8.0)
    sim = LiveSimulation(sc, tmp_path, "job-q", capacity=1024, speed=5.0, tick_s=0.0,
                         max_ahead_s=float("inf"))
    try:
        readers = [RingReader(p) for p in list_rings(tmp_path, "job-q")]
        ctl = Control(readers[0].path)
        while sim.virtual_s < 1.0:
            sim.step()
        dp = readers[0].comms()[1]
        target = int(dp["last_seq_entered"]) + 1
        ctl.pause(comm_id=int(dp["comm_id"]), seq=target)
        deadline = time.monotonic() + 30
        while not ctl.paused() and time.monotonic() < deadline:
            sim.step()
        assert ctl.paused()
        seen_v = sim.virtual_s
        req = ctl.submit(BenchRequest(BenchKind.GEMM, 4096))
        res = None
        while res is None and time.monotonic() < deadline:
            sim.step()
            res = ctl.result(req)
        assert res is not None and res.ok
        assert res.drain_ns > 0.05e9  # most of an iteration's GPU work was queued
        assert sim.virtual_s >= seen_v + res.drain_ns / 1e9 - 0.05
        mine = readers[0].comms()
        assert not mine["gpu_pending_op"].any()  # its GPU has drained
        assert int(mine[1]["last_seq_entered"]) == target - 1
        peer = members(readers)[int(dp["comm_id"])][2]  # rank 2: same stage and TP rank
        assert int(peer["gpu_pending_seq"]) == target and peer["inflight_enter_ns"] == 0
        assert int(peer["last_seq_entered"]) >= target  # its host ran on
        ctl.resume()
        recs = drain_all(sim, readers)
        assert not ctl.paused()
        dp_calls = recs[0][recs[0]["comm_id"] == dp["comm_id"]]
        assert int(dp_calls["seq"].max()) > target  # the job went on after the pause
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


def pending_ages(readers: list[RingReader]) -> list[float]:
    now = time.monotonic_ns()
    return [(now - int(c["gpu_pending_ns"])) / 1e9 for rd in readers for c in rd.comms()
            if c["gpu_pending_ns"]]


def test_held_back_or_finished_runs_do_not_look_hung(tmp_path: Path) -> None:
    """Held back by a reader that does not consume, the virtual clock stands still, so a call
    pending on a GPU must not show wall-clock time passing; once the run ends nothing is pending
    or inside NCCL. Otherwise the tracker would see hangs that the simulated job does not have."""
    sim = LiveSimulation(scenario(J, duration_s=20.0), tmp_path, "job-d", capacity=256, lead=0.5)
    col = Collector(tmp_path, "job-d")
    col.scan()
    readers = [RingReader(p) for p in list_rings(tmp_path, "job-d")]
    try:
        while sim.step():
            pass
        assert not sim.done  # held back: the collector has not drained anything
        before = pending_ages(readers)
        time.sleep(0.3)
        sim.step()
        after = pending_ages(readers)
        assert before and len(after) == len(before)
        assert max(a - b for a, b in zip(after, before, strict=True)) < 0.15
        assert max(col.counters(time.monotonic_ns()).inflight_s) < 0.25
        while not sim.done:
            if not sim.step():
                col.drain()
        sim.run()  # returns at once (done) and marks the job finished
        assert max(col.counters(time.monotonic_ns()).inflight_s) == 0.0
        assert pending_ages(readers) == []
    finally:
        for rd in readers:
            rd.close()
        col.close()
        sim.close()


def test_a_driver_busy_elsewhere_does_not_make_the_job_look_hung(tmp_path: Path) -> None:
    """run()'s callbacks may block (an HTTP poll on a loaded machine): the virtual clock stands
    still meanwhile, so the GPU-pending ages the agent reads must not grow on wall time."""
    sim = LiveSimulation(scenario(J, duration_s=10.0), tmp_path, "job-k", speed=10.0,
                         max_ahead_s=float("inf"))
    readers = [RingReader(p) for p in list_rings(tmp_path, "job-k")]
    seen: list[list[float]] = []

    def should_stop() -> bool:
        if sim.virtual_s > 2.0 and not seen and pending_ages(readers):
            time.sleep(0.8)
            seen.append(pending_ages(readers))
        return False

    try:
        sim.run(should_stop=should_stop)
        # virtual ages stay under an iteration (0.2 s); on wall time they would exceed 0.8 s
        assert seen and seen[0] and max(seen[0]) < 0.6
    finally:
        for rd in readers:
            rd.close()
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


def test_a_paced_run_does_not_leap_over_a_stall(tmp_path: Path) -> None:
    """Wall time lost between steps (a loaded machine, a slow callback) is not made up in one
    step: at 25x a 3 s stall would write 75 virtual seconds of every rank's calls at once, and
    simulating and writing those takes longer still, so the next leap is larger. A step moves
    the clock by at most speed x max_step_s; an ordinary step by speed x its wall time."""
    now = [0.0]
    sim = LiveSimulation(scenario(J, duration_s=60.0), tmp_path, "job-s", speed=25.0,
                         max_ahead_s=float("inf"), max_step_s=0.1, clock=lambda: now[0])
    try:
        now[0] += 0.04
        assert sim.step()
        assert sim.virtual_s == pytest.approx(1.0)
        now[0] += 3.0
        assert sim.step()
        assert sim.virtual_s == pytest.approx(1.0 + 25.0 * 0.1)
        with pytest.raises(ValueError):
            LiveSimulation(scenario(J, duration_s=1.0), tmp_path, "job-z", max_step_s=0.0)
    finally:
        sim.close()


def test_profiled_calls_of_long_iterations_come_timed(tmp_path: Path) -> None:
    """Iterations of ~6 s on a paced run (a host enqueues one up front, its GPU ends its last
    calls seconds later): each profiled record waits for its GPU times as long as the agent's
    reader would (several recent iterations), so once an iteration is known none reaches the
    reader untimed; before that (2 s) it goes out settled without times (GPU_LOST), never
    plainly untimed: a reader on the wall clock would hold that one until the wall clock passed
    its virtual return, and the run would stand still meanwhile (issue 23: a congested link's
    slow DP all-reduces never reached the analyzer's profile, the demo stalled for a minute)."""
    slow = {**J, "microbatch_compute_s": 2.0}
    sc = scenario(slow, duration_s=40.0)
    ticks = iter(np.arange(0.0, 1e4, 0.1))  # 0.1 virtual s a step, far ahead of the wall clock
    sim = LiveSimulation(sc, tmp_path, "job-w", capacity=1024, speed=1.0,
                         clock=lambda: float(next(ticks)))
    try:
        readers = [RingReader(p) for p in list_rings(tmp_path, "job-w")]
        for rd in readers:
            rd.control().set_mode("profile")
        got: list[list[np.ndarray]] = [[] for _ in readers]
        for _ in range(2000):  # 400 steps move the clock; a stalled run never ends
            if sim.done:
                break
            if not sim.step():
                for i, rd in enumerate(readers):
                    got[i].append(rd.poll())
        assert sim.done
        first_end = sim.mono0_ns + round(sim.iteration_times()[0][1] * 1e9)
        for g in got:
            rec = np.concatenate(g)
            late = rec["gpu_end_ns"].astype(np.int64) - rec["return_ns"].astype(np.int64)
            assert np.any(late > 2e9)  # the reader's shortest wait would not have covered it
            known = rec["enter_ns"] > np.uint64(first_end)
            assert known.sum() > 20 and np.all(rec["flags"][known] & TIMED == TIMED)
            lost = rec["flags"] & Flag.GPU_DONE == 0
            assert np.all(rec["flags"][lost] & (Flag.PROFILED | Flag.GPU_LOST)
                          == Flag.PROFILED | Flag.GPU_LOST)
        longest = max(d for _, d in sim.iteration_times())
        assert longest > 4.0 and sim.gpu_wait_s() == pytest.approx(4 * longest)
    finally:
        sim.close()
