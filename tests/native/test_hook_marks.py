"""The hook on the GPU timeline, over the asynchronous fake GPU: completion marks in the comm table
(monitor mode), profile-mode GPU times, and a validation that drains the rank's queued GPU work.

NCCL calls return once their work is enqueued, so the host fields of the comm table move within
microseconds; these tests check that the GPU fields follow the device instead: what is pending,
what is done, and a collective hung on the GPU while its host waits outside NCCL."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from greyhound import hookabi as H
from greyhound.fakejob import FakeJob, FakeJobSpec
from tests.native.helpers import bench_result, hook_lib, wait_for, wait_rings, world_entry


def _last_line(job: FakeJob, rank: int) -> str:
    return (job.workdir / f"rank{rank}.out").read_text().splitlines()[-1]


def test_marks_follow_the_device_not_the_host(native_build: Path, tmp_path: Path) -> None:
    # 40 ms of device compute per iteration; the host launches it in well under a millisecond and
    # then waits in its synchronisation, so the all-reduce is pending on the GPU most of the time.
    spec = FakeJobSpec(world_size=2, iters=60, compute_ms=40, compute_busy=0.0, job_id="follow")
    shm = tmp_path / "shm"
    samples: list[dict[str, int]] = []
    with FakeJob(spec, workdir=tmp_path / "w", hook=hook_lib(native_build), shm_dir=shm) as job:
        readers = [H.RingReader(p) for p in wait_rings(shm, "follow", 2)]
        job.wait_iteration(0, 5, 30)
        recs = readers[0].poll()
        for _ in range(150):
            c = world_entry(readers[0])
            samples.append({k: int(c[k]) for k in (
                "calls_entered", "calls_completed", "last_seq_entered", "inflight_enter_ns",
                "gpu_marks", "gpu_calls_done", "gpu_seq_done", "gpu_pending_ns", "gpu_pending_seq",
                "gpu_pending_op", "gpu_pending_dtype", "gpu_pending_count", "gpu_marks_lost")})
            time.sleep(0.01)
        recs = np.concatenate([recs, readers[0].poll()])
        assert job.wait(60) == [0, 0]
    assert all(s["gpu_marks"] == 1 for s in samples)
    # The host is inside NCCL for microseconds only: never seen there.
    assert sum(s["inflight_enter_ns"] != 0 for s in samples) <= 2
    pending = [s for s in samples if s["gpu_pending_ns"] != 0]
    assert len(pending) > 0.6 * len(samples)  # the GPU is behind its host most of the time
    enter = {int(r["seq"]): int(r["enter_ns"]) for r in recs if r["op"] == H.Op.ALLREDUCE}
    for s in pending:
        # The pending call is the oldest one the host enqueued and the GPU has not finished: the
        # one right after the last done, with the host's enqueue time and what it enqueued. The
        # poller passes every millisecond, so the host may have enqueued one more meanwhile.
        assert s["gpu_pending_seq"] == s["gpu_seq_done"] + 1
        assert s["last_seq_entered"] - s["gpu_pending_seq"] in (0, 1)
        assert s["calls_entered"] - s["gpu_calls_done"] in (1, 2)
        assert (s["gpu_pending_op"], s["gpu_pending_dtype"]) == (H.Op.ALLREDUCE, 7)
        assert s["gpu_pending_count"] == spec.bytes // 4
        if s["gpu_pending_seq"] in enter:
            assert s["gpu_pending_ns"] == enter[s["gpu_pending_seq"]]
    for s in samples:
        assert s["calls_completed"] == s["calls_entered"] or s["inflight_enter_ns"] != 0
        if s["gpu_pending_ns"] == 0:  # nothing pending: what the host enqueued is done (or
            # was enqueued since the poller's last pass)
            assert s["calls_entered"] - s["gpu_calls_done"] in (0, 1)
            assert s["last_seq_entered"] - s["gpu_seq_done"] in (0, 1)
    # The first calls (before the poller made the events) have no mark: counted, not fatal.
    assert 0 < samples[-1]["gpu_marks_lost"] <= 3


def test_collective_hung_on_the_gpu_is_pending_while_the_host_waits(native_build: Path,
                                                                    tmp_path: Path) -> None:
    spec = FakeJobSpec(world_size=2, iters=200, compute_ms=5, compute_busy=0.0, job_id="hang")
    shm = tmp_path / "shm"
    with FakeJob(spec, workdir=tmp_path / "w", hook=hook_lib(native_build), shm_dir=shm) as job:
        readers = [H.RingReader(p) for p in wait_rings(shm, "hang", 2)]
        job.wait_iteration(1, 10, 30)
        hung = int(world_entry(readers[1])["last_seq_entered"]) + 15  # the hook's seq, from 1
        job.faults.set(f"never_complete 1 {hung - 1}")  # the fake numbers collectives from 0
        wait_for(lambda: int(world_entry(readers[1])["gpu_pending_seq"]) == hung, 30, "no pending call")
        time.sleep(0.3)
        first = world_entry(readers[1])
        time.sleep(0.5)
        later = world_entry(readers[1])
        now = time.monotonic_ns()
        # On the GPU: the collective stays pending, its enqueue time fixed and ageing.
        assert int(later["gpu_pending_seq"]) == hung and int(later["gpu_pending_op"]) == H.Op.ALLREDUCE
        assert int(later["gpu_pending_ns"]) == int(first["gpu_pending_ns"]) > 0
        assert now - int(later["gpu_pending_ns"]) > 700_000_000
        assert int(later["gpu_seq_done"]) == hung - 1
        # On the host: the call was enqueued and returned long ago; no thread is inside NCCL. The
        # training thread is blocked in its stream synchronisation (the loss read) instead.
        assert int(later["last_seq_entered"]) == int(later["last_seq_completed"]) == hung
        assert int(later["inflight_enter_ns"]) == 0
        assert int(later["calls_completed"]) == int(later["calls_entered"])
        assert _last_line(job, 1) == f"sync it={hung - 1} " + _last_line(job, 1).split()[-1]
        # Its peer finished that collective on its GPU (rank 1 reached it) and hangs one later.
        assert int(world_entry(readers[0])["gpu_seq_done"]) >= hung
        job.faults.clear()
        wait_for(lambda: int(world_entry(readers[1])["gpu_seq_done"]) > hung, 30, "did not recover")
        assert job.wait(60) == [0, 0]


@pytest.mark.parametrize(("fault", "kind"), [("skip_call 1 {}", "h1"), ("mismatch 1 {}", "h2")])
def test_h1_and_h2_as_the_comm_tables_show_them(native_build: Path, tmp_path: Path, fault: str,
                                               kind: str) -> None:
    """H1: a rank whose host never enqueues the call (its last_seq_entered stays behind) while its
    peer's GPU waits in it; H2: ranks stuck at one seq with different calls enqueued."""
    spec = FakeJobSpec(world_size=2, iters=200, compute_ms=5, compute_busy=0.0, job_id=kind,
                       verbose=False)
    shm = tmp_path / "shm"
    with FakeJob(spec, workdir=tmp_path / "w", hook=hook_lib(native_build), shm_dir=shm) as job:
        readers = [H.RingReader(p) for p in wait_rings(shm, kind, 2)]
        wait_for(lambda: int(world_entry(readers[1])["last_seq_entered"]) >= 5, 30, "job did not start")
        at = int(world_entry(readers[1])["last_seq_entered"]) + 10  # workload iteration = fake seq
        job.faults.set(fault.format(at))
        wait_for(lambda: int(world_entry(readers[0])["gpu_pending_seq"]) == at + 1, 30, "no pending call")
        time.sleep(0.3)
        rows = [world_entry(r) for r in readers]
    count = spec.bytes // 4
    assert int(rows[0]["gpu_pending_seq"]) == at + 1 and int(rows[0]["gpu_pending_count"]) == count
    assert int(rows[0]["inflight_enter_ns"]) == 0 == int(rows[1]["inflight_enter_ns"])
    if kind == "h1":  # rank 1's host never enqueued it; nothing of it pending on its GPU
        assert int(rows[1]["last_seq_entered"]) == at == int(rows[1]["gpu_seq_done"])
        assert int(rows[1]["gpu_pending_ns"]) == 0
    else:  # both enqueued seq at + 1, with different counts: both hang in it
        assert int(rows[1]["gpu_pending_seq"]) == at + 1 == int(rows[1]["last_seq_entered"])
        assert int(rows[1]["gpu_pending_count"]) == count + 1


def test_marks_of_groups_and_the_pipeline_communicator(native_build: Path, tmp_path: Path) -> None:
    spec = FakeJobSpec(world_size=4, iters=80, compute_ms=4, compute_busy=0.0, tp=2, pp=2,
                       job_id="groups", verbose=False)
    shm = tmp_path / "shm"
    with FakeJob(spec, workdir=tmp_path / "w", hook=hook_lib(native_build), shm_dir=shm) as job:
        readers = [H.RingReader(p) for p in wait_rings(shm, "groups", 4)]
        wait_for(lambda: all(int(r.comms()["gpu_calls_done"].max()) > 40 for r in readers), 60,
              "marks did not advance")
        snaps = [r.comms() for r in readers]
        assert job.wait(60) == [0] * 4
    for comms in snaps:
        live = comms[(comms["state"] == H.CommState.ACTIVE) & (comms["calls_entered"] > 0)]
        assert len(live) == 3  # tp, dp and pp communicators; the world one carries no calls
        for c in live:
            assert int(c["gpu_marks"]) == 1
            assert int(c["calls_entered"]) - 2 <= int(c["gpu_calls_done"]) <= int(c["calls_entered"])
            assert int(c["gpu_marks_lost"]) <= 3
        pp = live[live["npeers"] > 0][0]
        assert int(pp["gpu_seq_done"]) == 0  # a send/recv-only communicator has no collectives
        assert int(pp["gpu_calls_done"]) > 30


def test_profile_gpu_times_are_the_device_timeline(native_build: Path, tmp_path: Path) -> None:
    spec = FakeJobSpec(world_size=2, iters=80, compute_ms=20, compute_busy=0.0, job_id="ptime",
                       verbose=False)
    shm = tmp_path / "shm"
    with FakeJob(spec, workdir=tmp_path / "w", hook=hook_lib(native_build), shm_dir=shm) as job:
        readers = [H.RingReader(p, gpu_wait_ns=5_000_000_000) for p in wait_rings(shm, "ptime", 2)]
        job.faults.set("slow_rank 1 3.0")  # rank 1's GPU computes 60 ms, rank 0's 20 ms
        for r in readers:
            r.control().set_mode("profile")
        assert job.wait(60) == [0, 0]
    timed = []
    for r in readers:
        recs = r.poll()
        ar = recs[(recs["op"] == H.Op.ALLREDUCE) & ((recs["flags"] & H.Flag.GPU_DONE) != 0)]
        assert len(ar) > 40
        timed.append({int(x["seq"]): x for x in ar})
    common = sorted(set(timed[0]) & set(timed[1]))[5:]
    assert len(common) > 30

    def med(rank: int, f: Callable[[np.void], int]) -> float:
        return statistics.median(f(timed[rank][s]) for s in common) / 1e6

    # The host enqueues in microseconds; the GPU reaches the collective after its compute.
    for rank in (0, 1):
        assert med(rank, lambda x: int(x["return_ns"]) - int(x["enter_ns"])) < 1.0
    assert med(0, lambda x: int(x["gpu_start_ns"]) - int(x["enter_ns"])) > 15.0
    assert med(1, lambda x: int(x["gpu_start_ns"]) - int(x["enter_ns"])) > 50.0
    # Rank 0's GPU arrives ~40 ms early and waits inside the collective; both end together.
    assert med(0, lambda x: int(x["gpu_end_ns"]) - int(x["gpu_start_ns"])) > 30.0
    assert med(1, lambda x: int(x["gpu_end_ns"]) - int(x["gpu_start_ns"])) < 5.0
    ends = [abs(int(timed[0][s]["gpu_end_ns"]) - int(timed[1][s]["gpu_end_ns"])) / 1e6 for s in common]
    assert statistics.median(ends) < 2.0
    # The host entries of the two ranks stay together: the straggler is late only on its GPU.
    enters = [abs(int(timed[0][s]["enter_ns"]) - int(timed[1][s]["enter_ns"])) / 1e6 for s in common]
    assert statistics.median(enters) < 5.0


def _pause_both(readers: list[H.RingReader], ctls: list[H.Control]) -> None:
    world = int(world_entry(readers[0])["comm_id"])
    target = max(int(world_entry(r)["last_seq_entered"]) for r in readers) + 2
    for c in ctls:
        c.pause(comm_id=world, seq=target)
    wait_for(lambda: all(c.paused() for c in ctls), 30, "ranks did not pause")


def test_validation_drains_queued_gpu_work_before_its_gemm(native_build: Path, tmp_path: Path) -> None:
    # 1 s of device compute per iteration: when a rank parks at its all-reduce, that compute is
    # still queued on its GPU. The GEMM (N=64: ~1 ms on the fake GPU at 0.5 GFLOPS) must wait for
    # it first, or it would share the SMs with it and measure the training instead of the GPU.
    # The second is slack for a busy machine: the GEMM is submitted after the test saw the pause.
    spec = FakeJobSpec(world_size=2, iters=40, compute_ms=1000, compute_busy=0.0, kernels=2,
                       job_id="drain", verbose=False)
    shm = tmp_path / "shm"
    with FakeJob(spec, workdir=tmp_path / "w", hook=hook_lib(native_build), shm_dir=shm) as job:
        readers = [H.RingReader(p) for p in wait_rings(shm, "drain", 2)]
        ctls = [r.control() for r in readers]
        wait_for(lambda: int(world_entry(readers[0])["last_seq_entered"]) >= 2, 30, "job did not start")
        _pause_both(readers, ctls)
        # The parked call is not enqueued; the compute before it is. The previous iteration's
        # all-reduce is done (the rank synchronised), but the hook's poller retires its mark
        # asynchronously (every ~1 ms, later on a busy machine): CI read it still pending once.
        wait_for(lambda: int(world_entry(readers[0])["gpu_pending_ns"]) == 0, 30,
                 "a call stayed pending on the GPU of a parked rank")
        res = bench_result(ctls[0], ctls[0].submit(H.BenchRequest(kind=H.BenchKind.GEMM, size=64, repeat=3)))
        again = bench_result(ctls[0], ctls[0].submit(H.BenchRequest(kind=H.BenchKind.GEMM, size=64)))
        for c in ctls:
            c.resume()
        job.kill()
    assert res.ok and len(res.durations_ns) == 3, res
    assert res.drain_ns > 100_000_000  # waited for the queued compute (up to 1 s of it)
    assert max(res.durations_ns) < 50_000_000  # GPU time of the GEMM alone
    assert min(res.durations_ns) >= 900_000  # 2 * 64^3 / 0.5 GFLOPS = 1.05 ms on the fake GPU
    assert again.ok and again.drain_ns < 50_000_000  # nothing queued any more
