"""The fake NCCL, CUDA and cuBLAS behave like the real ones where the hook and detectors look:
work is asynchronous (a call enqueues on a stream and returns; the fake device runs it when the
stream reaches it), ranks rendezvous across processes on their devices, a slow rank or link costs
what the model says on the device timeline, and the H1/H2/H3 faults stop a job the way real hangs
do."""

from __future__ import annotations

import ctypes
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from greyhound.fakejob import FakeJob, FakeJobSpec, IterTimes


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def _job(tmp_path: Path, spec: FakeJobSpec, **env: str) -> FakeJob:
    return FakeJob(spec, workdir=tmp_path, hook=None, shm_dir=None, env=env)


def _all_iters(job: FakeJob) -> list[list[IterTimes]]:
    return [job.iterations(r) for r in range(job.spec.world_size)]


def _stalled_at(job: FakeJob, settle: float = 1.0) -> list[int]:
    """Last finished iteration per rank once the job stops progressing (after every rank has
    finished one, so a slow start is not mistaken for a stall)."""
    before: list[int] = []
    for _ in range(40):
        time.sleep(settle / 4)
        now = [(its[-1].it if its else -1) for its in _all_iters(job)]
        if now == before and min(now) >= 0:
            return now
        before = now
    raise AssertionError("job kept progressing")


def test_ranks_rendezvous_and_complete(tmp_path: Path) -> None:
    spec = FakeJobSpec(world_size=4, iters=30, compute_ms=2.0, compute_busy=0.5, bytes=8 << 20)
    with _job(tmp_path, spec) as job:
        assert job.wait(timeout=60) == [0, 0, 0, 0]
    iters = _all_iters(job)
    assert [len(x) for x in iters] == [30] * 4
    for i in range(30):
        assert all(iters[r][i].gpu_arrive_ns > 0 for r in range(4))
        last_arrival = max(iters[r][i].gpu_arrive_ns for r in range(4))
        # No rank's GPU leaves the all-reduce before the last rank's GPU has reached it (the
        # transfer alone takes ~0.6 ms; the event anchors err by microseconds).
        assert all(iters[r][i].gpu_done_ns >= last_arrival + 200_000 for r in range(4))
        # The host waits for its device: its synchronisation ends after the all-reduce.
        assert all(iters[r][i].end_ns >= iters[r][i].gpu_done_ns - 200_000 for r in range(4))


def test_slow_rank_is_late_on_the_gpu_not_on_the_host(tmp_path: Path) -> None:
    # Sleep-only host work: on a shared 2-core CI machine busy ranks would add scheduling noise.
    spec = FakeJobSpec(world_size=4, iters=60, compute_ms=10.0, compute_busy=0.0)
    with _job(tmp_path, spec) as job:
        job.wait_iteration(0, 14, timeout=30)
        job.faults.set("slow_rank 2 3.0")
        job.wait_iteration(0, 34, timeout=30)
        job.faults.clear("slow_rank 2 3.0")
        assert job.wait(timeout=60) == [0, 0, 0, 0]
    its = _all_iters(job)
    r0 = [t.total_ms for t in its[0]]
    before, during, after = (statistics.median(r0[a:b]) for a, b in ((2, 12), (20, 32), (45, 60)))
    # Rank 2's GPU computes 30 ms instead of 10: every rank's iteration grows by about 20 ms.
    assert during > before + 10.0 and during > after + 10.0
    # Rank 0's GPU computes at normal speed and waits in the all-reduce for the straggler's GPU,
    # which arrives last and hardly waits.
    assert statistics.median(t.gpu_comm_ms for t in its[0][20:32]) > 12.0
    assert statistics.median(t.gpu_comm_ms for t in its[2][20:32]) < 8.0
    late = [(its[2][i].gpu_arrive_ns - its[0][i].gpu_arrive_ns) / 1e6 for i in range(20, 32)]
    assert statistics.median(late) > 14.0
    # On the host, the straggler launches its collectives when everyone else does: every host
    # synchronises once per iteration and leaves it when the collective ends on its GPU.
    host = [abs(its[2][i].compute_end_ns - its[0][i].compute_end_ns) / 1e6 for i in range(20, 32)]
    assert statistics.median(host) < 3.0
    # and the host waits in its synchronisation, not in NCCL: it is blocked for the GPU's compute.
    assert statistics.median(t.comm_ms for t in its[2][20:32]) > 20.0


def test_slow_host_matters_once_the_host_falls_behind_its_gpu(tmp_path: Path) -> None:
    # 20 ms of device compute, 1 ms of host launch work per iteration: the host is far ahead.
    spec = FakeJobSpec(world_size=2, iters=75, compute_ms=20.0, compute_busy=0.05)
    with _job(tmp_path, spec) as job:
        job.wait_iteration(1, 14, timeout=30)
        job.faults.set("slow_host 1 4.0")  # 4 ms of host work: still ahead of its GPU
        job.wait_iteration(1, 39, timeout=30)
        job.faults.clear()
        job.faults.set("slow_host 1 40.0")  # 40 ms: the host cannot keep its GPU busy any more
        assert job.wait(timeout=60) == [0, 0]
    its = _all_iters(job)
    period = [statistics.median(t.total_ms for t in its[0][a:b]) for a, b in ((4, 14), (22, 38), (50, 74))]
    assert period[1] < period[0] + 5.0, period  # the host kept its GPU busy: nothing changes
    assert period[2] > period[1] + 12.0 and period[2] > period[0] + 8.0, period
    # Host-bound: rank 1's GPU waits for launches, so it reaches the collectives late although its
    # compute is no slower, and rank 0's GPU waits inside them.
    assert statistics.median(t.gpu_comm_ms for t in its[0][50:74]) > 10.0


def _median_coll_ms(job: FakeJob) -> float:
    its = _all_iters(job)
    n = len(its[0])
    return statistics.median(
        (min(its[r][i].gpu_done_ns for r in range(4)) - max(its[r][i].gpu_arrive_ns for r in range(4)))
        / 1e6 for i in range(2, n)
    )


@pytest.mark.parametrize(("fault", "factor"), [(None, 1.0), ("slow_link 1 2 4", 4.0),
                                               ("slow_link 0 2 8", 1.0)])
def test_slow_link_follows_ring_closed_form(tmp_path: Path, fault: str | None, factor: float) -> None:
    nbytes = 32 << 20
    spec = FakeJobSpec(world_size=4, iters=12, compute_ms=0.0, bytes=nbytes)
    job = _job(tmp_path, spec, FAKE_NCCL_BW_GBPS="10", FAKE_NCCL_LAT_US="5")
    if fault:
        job.faults.set(fault)  # 0-2 is no ring link for 4 ranks: no effect
    with job:
        assert job.wait(timeout=60) == [0, 0, 0, 0]
    n = 4
    expect_ms = (2 * (n - 1) / n * nbytes / (10e9 / factor) + 2 * (n - 1) * 5e-6) * 1e3
    assert _median_coll_ms(job) == pytest.approx(expect_ms, rel=0.15, abs=1.5)


def test_h1_skipped_call_stalls_until_fault_removed(tmp_path: Path) -> None:
    spec = FakeJobSpec(world_size=4, iters=12, compute_ms=1.0, compute_busy=0.0)
    job = _job(tmp_path, spec)
    job.faults.set("skip_call 1 5")
    with job:
        assert _stalled_at(job) == [4, 4, 4, 4]
        job.faults.clear()
        assert job.wait(timeout=30) == [0, 0, 0, 0]


def test_h2_mismatched_count_hangs_and_is_logged(tmp_path: Path) -> None:
    spec = FakeJobSpec(world_size=4, iters=12, compute_ms=1.0, compute_busy=0.0)
    job = _job(tmp_path, spec, FAKE_NCCL_LOG=str(tmp_path / "fake.log"))
    job.faults.set("mismatch 3 5")
    with job:
        assert _stalled_at(job) == [4, 4, 4, 4]
        assert job.running()
    log = (tmp_path / "fake.log").read_text()
    assert "mismatch seq=5" in log and "count=262145" in log


def test_h3_call_that_never_completes(tmp_path: Path) -> None:
    spec = FakeJobSpec(world_size=4, iters=12, compute_ms=1.0, compute_busy=0.0)
    job = _job(tmp_path, spec)
    job.faults.set("never_complete 2 5")
    with job:
        # Rank 2 entered seq 5, so the others finish it and then wait for rank 2 at seq 6.
        assert _stalled_at(job) == [5, 5, 4, 5]


def test_nonblocking_workload_polls_through_inprogress(tmp_path: Path) -> None:
    spec = FakeJobSpec(world_size=2, iters=5, compute_ms=1.0, compute_busy=0.0)
    job = _job(tmp_path, spec, GH_NONBLOCKING="1")
    job.faults.set("inprogress 1")
    with job:
        assert job.wait(timeout=30) == [0, 0]
    assert [len(x) for x in _all_iters(job)] == [5, 5]


def test_workload_library_entry_point(native_build: Path, tmp_path: Path) -> None:
    code = (
        "import ctypes\n"
        f"lib = ctypes.CDLL({str(native_build / 'libghworkload.so')!r})\n"
        "raise SystemExit(lib.gh_workload_main(0, None))\n"
    )
    env = {"RANK": "0", "WORLD_SIZE": "1", "GH_ITERS": "3", "GH_COMPUTE_MS": "1",
           "GH_RDZV": str(tmp_path / "rdzv"), "GH_VERBOSE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=30, check=True)
    assert [line.split()[0] for line in out.stdout.splitlines() if line.startswith("it=")] == [
        "it=0", "it=1", "it=2"]


def test_split_membership_and_pipeline_p2p(tmp_path: Path) -> None:
    spec = FakeJobSpec(world_size=8, iters=3, compute_ms=1.0, compute_busy=0.0, tp=2, pp=2)
    with _job(tmp_path, spec) as job:
        assert job.wait(timeout=60) == [0] * 8
    for r in range(8):
        comms = {}
        for line in (tmp_path / f"rank{r}.out").read_text().splitlines():
            if line.startswith("comm "):
                _, name, rank, n = line.split()
                comms[name] = (int(rank.split("=")[1]), int(n.split("=")[1]))
        assert comms == {"world": (r, 8), "tp": (r % 2, 2), "pp": ((r // 2) % 2, 2), "dp": (r // 4, 2)}
        assert len(job.iterations(r)) == 3


@pytest.fixture
def nccl(native_build: Path) -> ctypes.CDLL:
    return ctypes.CDLL(str(native_build / "fake" / "libnccl.so.2"))


@pytest.fixture
def cuda(native_build: Path) -> ctypes.CDLL:
    """The fake CUDA runtime the fake NCCL loaded (one device per process)."""
    return ctypes.CDLL(str(native_build / "fake" / "libcudart.so.12"))


def _init_all(nccl: ctypes.CDLL, n: int) -> list[ctypes.c_void_p]:
    comms = (ctypes.c_void_p * n)()
    assert nccl.ncclCommInitAll(comms, n, None) == 0
    return [ctypes.c_void_p(c) for c in comms]


def test_init_all_group_and_queries(nccl: ctypes.CDLL, cuda: ctypes.CDLL) -> None:
    comms = _init_all(nccl, 4)
    count, rank = ctypes.c_int(), ctypes.c_int()
    for i, c in enumerate(comms):
        assert nccl.ncclCommCount(c, ctypes.byref(count)) == 0 and count.value == 4
        assert nccl.ncclCommUserRank(c, ctypes.byref(rank)) == 0 and rank.value == i
    # One thread drives all ranks, so the calls must be grouped, as with real NCCL.
    assert nccl.ncclGroupStart() == 0
    for c in comms:
        assert nccl.ncclAllReduce(None, None, ctypes.c_size_t(1024), 7, 0, c, None) == 0
        assert nccl.ncclBroadcast(None, None, ctypes.c_size_t(64), 7, 1, c, None) == 0
    assert nccl.ncclGroupEnd() == 0
    assert cuda.cudaStreamSynchronize(None) == 0
    err = ctypes.c_int()
    for c in comms:
        assert nccl.ncclCommGetAsyncError(c, ctypes.byref(err)) == 0 and err.value == 0
        assert nccl.ncclCommDestroy(c) == 0


@pytest.mark.parametrize("factor", [1.0, 5.0])
def test_send_recv_pair_takes_the_link_time(nccl: ctypes.CDLL, cuda: ctypes.CDLL, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch, factor: float) -> None:
    faults = tmp_path / "faults.txt"
    faults.write_text(f"slow_link 0 1 {factor}\n")
    monkeypatch.setenv("FAKE_NCCL_FAULTS", str(faults))
    comms = _init_all(nccl, 2)  # InitAll ranks are global ranks 0 and 1
    count = 25_000_000  # 100 MB of float32: 10 ms at the default 10 GB/s
    a, b = ctypes.c_void_p(), ctypes.c_void_p()
    assert cuda.cudaEventCreate(ctypes.byref(a)) == 0 and cuda.cudaEventCreate(ctypes.byref(b)) == 0
    t0 = time.perf_counter()
    assert cuda.cudaEventRecord(a, None) == 0
    assert nccl.ncclGroupStart() == 0
    assert nccl.ncclSend(None, ctypes.c_size_t(count), 7, 1, comms[0], None) == 0
    assert nccl.ncclRecv(None, ctypes.c_size_t(count), 7, 0, comms[1], None) == 0
    assert nccl.ncclGroupEnd() == 0
    assert cuda.cudaEventRecord(b, None) == 0
    assert cuda.cudaStreamSynchronize(None) == 0
    waited_ms = (time.perf_counter() - t0) * 1e3
    ms = ctypes.c_float()
    assert cuda.cudaEventElapsedTime(ctypes.byref(ms), a, b) == 0
    expect_ms = 4 * count / (10e9 / factor) * 1e3 + 0.005
    # On the GPU's timeline the transfer takes the link time; the host waited at least that.
    assert expect_ms - 0.01 <= ms.value < expect_ms + 5.0
    assert waited_ms >= expect_ms - 0.01
    for c in comms:
        nccl.ncclCommDestroy(c)
    for h in (a, b):
        cuda.cudaEventDestroy(h)


def test_collective_returns_at_once_and_runs_on_the_device(nccl: ctypes.CDLL, cuda: ctypes.CDLL) -> None:
    comms = _init_all(nccl, 2)
    # 6 GB of float32, 2 ranks: 600 ms at 10 GB/s (no buffer: the fake GPU only keeps the time).
    # The host's checks below must run while the device is still at it: a busy 2-core machine may
    # hold the test's thread for tens of ms, so the device's time is far longer than that.
    count = ctypes.c_size_t(1_500_000_000)
    before, after = ctypes.c_void_p(), ctypes.c_void_p()
    assert cuda.cudaEventCreate(ctypes.byref(before)) == 0
    assert cuda.cudaEventCreate(ctypes.byref(after)) == 0
    host_ms, waited_ms, device_ms = [], [], []
    for _ in range(3):
        assert cuda.cudaEventRecord(before, None) == 0
        t0 = time.perf_counter()
        assert nccl.ncclGroupStart() == 0
        for c in comms:
            assert nccl.ncclAllReduce(None, None, count, 7, 0, c, None) == 0
        assert nccl.ncclGroupEnd() == 0
        host_ms.append((time.perf_counter() - t0) * 1e3)
        assert cuda.cudaEventRecord(after, None) == 0
        assert cuda.cudaEventQuery(after) == 600  # cudaErrorNotReady: the device is still at it
        assert cuda.cudaStreamQuery(None) == 600
        ms = ctypes.c_float()
        assert cuda.cudaEventElapsedTime(ctypes.byref(ms), before, after) == 600
        t1 = time.perf_counter()
        assert cuda.cudaEventSynchronize(after) == 0  # blocks until the device reaches the event
        waited_ms.append((time.perf_counter() - t1) * 1e3)
        assert cuda.cudaEventQuery(after) == 0 and cuda.cudaStreamQuery(None) == 0
        assert cuda.cudaEventElapsedTime(ctypes.byref(ms), before, after) == 0
        device_ms.append(ms.value)
    assert statistics.median(host_ms) < 1.0 and max(host_ms) < 50.0, host_ms
    assert min(device_ms) >= 599.0 and max(device_ms) < 2000.0, device_ms
    assert min(waited_ms) > 400.0, waited_ms
    err = ctypes.c_int()
    for c in comms:
        assert nccl.ncclCommGetAsyncError(c, ctypes.byref(err)) == 0 and err.value == 0
        assert nccl.ncclCommDestroy(c) == 0
    assert cuda.cudaEventDestroy(before) == 0 and cuda.cudaEventDestroy(after) == 0


def test_compute_shares_the_device_collectives_do_not(nccl: ctypes.CDLL, cuda: ctypes.CDLL) -> None:
    side = ctypes.c_void_p()
    assert cuda.cudaStreamCreateWithFlags(ctypes.byref(side), 1) == 0
    a, b = ctypes.c_void_p(), ctypes.c_void_p()
    assert cuda.cudaEventCreate(ctypes.byref(a)) == 0 and cuda.cudaEventCreate(ctypes.byref(b)) == 0
    ms = ctypes.c_float()
    # A kernel launched on another stream behind 100 ms of queued compute waits for the SMs.
    assert cuda.cudaEventRecord(a, side) == 0  # an idle stream: reached at once
    assert cuda.fakeGpuSleep(None, ctypes.c_longlong(100_000_000)) == 0
    assert cuda.fakeGpuSleep(side, ctypes.c_longlong(5_000_000)) == 0
    assert cuda.cudaEventRecord(b, side) == 0
    assert cuda.cudaEventSynchronize(b) == 0
    assert cuda.cudaEventElapsedTime(ctypes.byref(ms), a, b) == 0
    assert 104.9 <= ms.value < 500.0, ms.value
    assert cuda.cudaStreamSynchronize(None) == 0
    # A collective hung on the default stream (rank 1 never enqueues) holds no SMs: a kernel on
    # another stream still runs in its own time.
    comms = _init_all(nccl, 2)
    assert nccl.ncclAllReduce(None, None, ctypes.c_size_t(8), 7, 0, comms[0], None) == 0
    assert cuda.fakeGpuSleep(None, ctypes.c_longlong(1_000_000)) == 0  # queued behind the hang
    assert cuda.cudaEventRecord(a, side) == 0
    assert cuda.fakeGpuSleep(side, ctypes.c_longlong(20_000_000)) == 0
    assert cuda.cudaEventRecord(b, side) == 0
    assert cuda.cudaEventSynchronize(b) == 0
    assert cuda.cudaEventElapsedTime(ctypes.byref(ms), a, b) == 0
    assert 19.0 <= ms.value < 80.0, ms.value
    assert cuda.cudaStreamQuery(None) == 600
    assert nccl.ncclCommAbort(comms[0]) == 0
    assert cuda.cudaStreamSynchronize(None) == 0
    nccl.ncclCommDestroy(comms[1])
    for h in (a, b):
        assert cuda.cudaEventDestroy(h) == 0
    assert cuda.cudaStreamDestroy(side) == 0


def test_abort_releases_a_collective_hung_on_the_device(nccl: ctypes.CDLL, cuda: ctypes.CDLL) -> None:
    comms = _init_all(nccl, 2)
    t0 = time.perf_counter()
    # Real NCCL enqueues and answers ncclSuccess even for a collective that will hang.
    assert nccl.ncclAllReduce(None, None, ctypes.c_size_t(8), 7, 0, comms[0], None) == 0
    assert time.perf_counter() - t0 < 0.5
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(cuda.cudaStreamSynchronize(None)))
    t.start()
    time.sleep(0.2)
    assert t.is_alive()  # the host blocks in its synchronisation: rank 1 never enqueued
    assert cuda.cudaStreamQuery(None) == 600
    assert nccl.ncclCommAbort(comms[0]) == 0
    t.join(timeout=5)
    assert not t.is_alive() and result == [0]
    async_err = ctypes.c_int()
    assert nccl.ncclCommGetAsyncError(comms[1], ctypes.byref(async_err)) == 0
    assert async_err.value == 6  # ncclRemoteError for the peer, reported asynchronously
    nccl.ncclCommDestroy(comms[1])


def test_a_communicators_operations_run_in_order_whatever_their_streams(
        nccl: ctypes.CDLL, cuda: ctypes.CDLL) -> None:
    """Real NCCL launches every operation of a communicator behind its previous one (its shared
    device stream): a send whose receiver never posts, on a stream of its own, holds the
    communicator's next all-reduce on the default stream, until the communicator is aborted."""
    comms = _init_all(nccl, 2)
    side = ctypes.c_void_p()
    assert cuda.cudaStreamCreateWithFlags(ctypes.byref(side), 1) == 0
    assert nccl.ncclSend(None, ctypes.c_size_t(64), 7, 1, comms[0], side) == 0  # never received
    # Both ranks' all-reduce is enqueued (one thread drives both: a group), on the default stream.
    assert nccl.ncclGroupStart() == 0
    for c in comms:
        assert nccl.ncclAllReduce(None, None, ctypes.c_size_t(8), 7, 0, c, None) == 0
    assert nccl.ncclGroupEnd() == 0
    time.sleep(0.3)
    assert cuda.cudaStreamQuery(None) == 600  # held behind the lonely send of comm 0
    other = ctypes.c_void_p()  # a different communicator is not held
    assert cuda.cudaStreamCreateWithFlags(ctypes.byref(other), 1) == 0
    pair = _init_all(nccl, 2)
    assert nccl.ncclGroupStart() == 0
    for c in pair:
        assert nccl.ncclAllReduce(None, None, ctypes.c_size_t(8), 7, 0, c, other) == 0
    assert nccl.ncclGroupEnd() == 0
    assert cuda.cudaStreamSynchronize(other) == 0
    assert cuda.cudaStreamQuery(None) == 600
    assert nccl.ncclCommAbort(comms[0]) == 0  # lets the send go, in error, and what queued behind
    t0 = time.perf_counter()
    assert cuda.cudaStreamSynchronize(None) == 0
    assert cuda.cudaStreamSynchronize(side) == 0
    assert time.perf_counter() - t0 < 5.0
    for c in (comms[1], *pair):
        nccl.ncclCommDestroy(c)
    for s in (side, other):
        assert cuda.cudaStreamDestroy(s) == 0


def test_destroy_releases_this_ranks_hung_collective(nccl: ctypes.CDLL, cuda: ctypes.CDLL) -> None:
    comms = _init_all(nccl, 2)
    assert nccl.ncclAllReduce(None, None, ctypes.c_size_t(8), 7, 0, comms[0], None) == 0
    time.sleep(0.1)
    assert cuda.cudaStreamQuery(None) == 600  # hung: rank 1 never enqueues
    assert nccl.ncclCommDestroy(comms[0]) == 0
    t0 = time.perf_counter()
    assert cuda.cudaStreamSynchronize(None) == 0
    assert time.perf_counter() - t0 < 5.0
    nccl.ncclCommDestroy(comms[1])


def test_memory_operations_run_in_stream_order(cuda: ctypes.CDLL) -> None:
    buf = (ctypes.c_ubyte * 64)()
    src = (ctypes.c_ubyte * 64)(*range(64))
    assert cuda.fakeGpuSleep(None, ctypes.c_longlong(100_000_000)) == 0
    assert cuda.cudaMemsetAsync(buf, 7, ctypes.c_size_t(64), None) == 0
    assert cuda.cudaMemcpyAsync(ctypes.byref(buf, 32), src, ctypes.c_size_t(16), 4, None) == 0
    assert bytes(buf) == bytes(64)  # queued behind 100 ms of compute: not run yet
    assert cuda.cudaStreamSynchronize(None) == 0
    assert bytes(buf) == bytes([7] * 32) + bytes(range(16)) + bytes([7] * 16)


def test_exit_and_fork_with_a_collective_hung_on_the_device(native_build: Path) -> None:
    code = (
        "import ctypes, os, sys\n"
        f"nccl = ctypes.CDLL({str(native_build / 'fake' / 'libnccl.so.2')!r})\n"
        f"cuda = ctypes.CDLL({str(native_build / 'fake' / 'libcudart.so.12')!r})\n"
        "comms = (ctypes.c_void_p * 2)()\n"
        "assert nccl.ncclCommInitAll(comms, 2, None) == 0\n"
        "assert nccl.ncclAllReduce(None, None, ctypes.c_size_t(8), 7, 0,"
        " ctypes.c_void_p(comms[0]), None) == 0\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"  # no executors in the child: its device is unusable, never a hang
        "    os._exit(cuda.cudaStreamSynchronize(None))\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print(os.waitstatus_to_exitcode(status))\n"
        "sys.exit(0)\n"  # the parent exits with the collective still hung on its device
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"  # cudaErrorInitializationError


def test_inprogress_config_reports_then_completes(nccl: ctypes.CDLL, cuda: ctypes.CDLL, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    faults = tmp_path / "faults.txt"
    faults.write_text("inprogress 0\n")
    monkeypatch.setenv("FAKE_NCCL_FAULTS", str(faults))
    monkeypatch.setenv("RANK", "0")
    uid, comm = UniqueId(), ctypes.c_void_p()
    assert nccl.ncclGetUniqueId(ctypes.byref(uid)) == 0
    assert nccl.ncclCommInitRankConfig(ctypes.byref(comm), 1, uid, 0, None) == 7
    states, err = [], ctypes.c_int()
    for _ in range(4):
        assert nccl.ncclCommGetAsyncError(comm, ctypes.byref(err)) == 0
        states.append(err.value)
    assert states == [7, 7, 0, 0]
    assert nccl.ncclAllReduce(None, None, ctypes.c_size_t(4), 7, 0, comm, None) == 7
    faults.write_text("")
    time.sleep(0.01)
    rc = nccl.ncclAllReduce(None, None, ctypes.c_size_t(4), 7, 0, comm, None)
    assert rc == 0, (rc, cuda.cudaGetLastError())  # on a launch failure: the CUDA error
    nccl.ncclCommDestroy(comm)


def test_bcast_calls_broadcast_through_the_plt(native_build: Path, tmp_path: Path) -> None:
    lib = native_build / "fake" / "libnccl.so.2"
    relocs = subprocess.run(["readelf", "-r", "--wide", str(lib)], capture_output=True, text=True,
                            check=True).stdout
    assert any("JUMP_SLOT" in line and line.split()[-3] == "ncclBroadcast"
               for line in relocs.splitlines())
    syms = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True,
                          text=True, check=True).stdout.split("\n")
    table = {line.split()[2]: (line.split()[0], line.split()[1]) for line in syms if line}
    for name in ("AllReduce", "Bcast", "Broadcast", "CommInitRank", "GroupEnd", "Send"):
        assert table[f"nccl{name}"][1] == "W" and table[f"pnccl{name}"][1] == "T"
        assert table[f"nccl{name}"][0] == table[f"pnccl{name}"][0]
    # A preloaded shim sees the nested call, as an LD_PRELOAD hook would.
    shim = tmp_path / "shim.so"
    (tmp_path / "shim.c").write_text(
        "#define _GNU_SOURCE\n#include <dlfcn.h>\n#include <stddef.h>\nint shim_calls;\n"
        "typedef int (*bc_t)(const void*, void*, size_t, int, int, void*, void*);\n"
        "int ncclBroadcast(const void *s, void *r, size_t n, int t, int root, void *c, void *st) {\n"
        "  shim_calls++;\n  void *h = dlopen(\"libnccl.so.2\", RTLD_LAZY | RTLD_NOLOAD);\n"
        "  return ((bc_t)dlsym(h, \"pncclBroadcast\"))(s, r, n, t, root, c, st);\n}\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(shim), str(tmp_path / "shim.c"), "-ldl"],
                   check=True)
    code = (
        "import ctypes\n"
        f"nccl = ctypes.CDLL({str(lib)!r})\n"
        "comms = (ctypes.c_void_p * 1)()\n"
        "assert nccl.ncclCommInitAll(comms, 1, None) == 0\n"
        "assert nccl.ncclBcast(None, ctypes.c_size_t(8), 7, 0, ctypes.c_void_p(comms[0]), None) == 0\n"
        f"print(ctypes.c_int.in_dll(ctypes.CDLL({str(shim)!r}), 'shim_calls').value)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env={"LD_PRELOAD": str(shim)},
                         capture_output=True, text=True, check=True, timeout=30)
    assert out.stdout.strip() == "1"


def test_noop_mode_returns_without_rendezvous(native_build: Path) -> None:
    code = (
        "import ctypes\n"
        f"nccl = ctypes.CDLL({str(native_build / 'fake' / 'libnccl.so.2')!r})\n"
        "comms = (ctypes.c_void_p * 2)()\n"
        "assert nccl.ncclCommInitAll(comms, 2, None) == 0\n"
        "for _ in range(1000):\n"  # rank 1 never calls: only no-op mode can return
        "    assert nccl.ncclAllReduce(None, None, ctypes.c_size_t(8), 7, 0,"
        " ctypes.c_void_p(comms[0]), None) == 0\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env={"FAKE_NCCL_NOOP": "1"},
                         capture_output=True, text=True, timeout=30, check=True)
    assert out.stdout.strip() == "ok"


def test_fake_cuda_events_lag_and_capture(native_build: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = ctypes.CDLL(str(native_build / "fake" / "libcudart.so.12"))
    faults = tmp_path / "faults.txt"
    faults.write_text("")
    monkeypatch.setenv("FAKE_NCCL_FAULTS", str(faults))
    monkeypatch.setenv("RANK", "1")
    a, b = ctypes.c_void_p(), ctypes.c_void_p()
    assert cuda.cudaEventCreateWithFlags(ctypes.byref(a), 0) == 0
    assert cuda.cudaEventCreate(ctypes.byref(b)) == 0
    assert cuda.cudaEventRecord(a, None) == 0 and cuda.cudaEventQuery(a) == 0
    time.sleep(0.05)
    assert cuda.cudaEventRecord(b, None) == 0
    ms = ctypes.c_float()
    assert cuda.cudaEventElapsedTime(ctypes.byref(ms), a, b) == 0
    assert 45.0 <= ms.value < 500.0
    faults.write_text("gpu_lag_ms 1 200\n")
    time.sleep(0.01)
    assert cuda.cudaEventRecord(b, None) == 0
    assert cuda.cudaEventQuery(b) == 600  # cudaErrorNotReady: the poller must come back
    assert cuda.cudaEventElapsedTime(ctypes.byref(ms), a, b) == 600
    assert cuda.cudaEventSynchronize(b) == 0 and cuda.cudaEventQuery(b) == 0
    # A global-mode graph capture on the default stream: created streams are not capturing, event
    # records on the captured stream are graph nodes, queries are illegal until the thread goes
    # thread-local.
    faults.write_text("capture 1\n")
    time.sleep(0.01)
    status, side = ctypes.c_int(), ctypes.c_void_p()
    assert cuda.cudaStreamIsCapturing(None, ctypes.byref(status)) == 0 and status.value == 1
    assert cuda.cudaStreamCreate(ctypes.byref(side)) == 0
    assert cuda.cudaStreamIsCapturing(side, ctypes.byref(status)) == 0 and status.value == 0
    assert cuda.cudaEventRecord(a, None) == 0 and cuda.cudaEventRecord(b, side) == 0
    assert cuda.cudaEventQuery(b) == 900  # cudaErrorStreamCaptureUnsupported
    mode = ctypes.c_int(1)
    assert cuda.cudaThreadExchangeStreamCaptureMode(ctypes.byref(mode)) == 0 and mode.value == 0
    assert cuda.cudaEventQuery(b) == 0 and cuda.cudaEventSynchronize(b) == 0
    violations, nodes = ctypes.c_long(), ctypes.c_long()
    cuda.fakeCudaCaptureStats(ctypes.byref(violations), ctypes.byref(nodes))
    assert (violations.value, nodes.value) == (1, 1)
    assert cuda.cudaThreadExchangeStreamCaptureMode(ctypes.byref(mode)) == 0  # back to global
    assert cuda.cudaStreamDestroy(side) == 0
    assert cuda.cudaEventDestroy(a) == 0 and cuda.cudaEventDestroy(b) == 0
    assert cuda.cudaGetErrorString(600) is not None


def test_fake_cublas_sgemm_is_right_and_slowed(native_build: Path, cuda: ctypes.CDLL, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    blas = ctypes.CDLL(str(native_build / "fake" / "libcublas.so.12"))
    faults = tmp_path / "faults.txt"
    faults.write_text("")
    monkeypatch.setenv("FAKE_NCCL_FAULTS", str(faults))
    monkeypatch.setenv("RANK", "3")
    # The fake GPU's own rate (read at this process's first GEMM): each GEMM lasts at least
    # 2mnk / 0.2 GFLOPS = 4.9 ms whatever else the shared CPU runs, so the ratio below is stable.
    monkeypatch.setenv("FAKE_GPU_GFLOPS", "0.2")
    rng = np.random.default_rng(7)
    m, n, k = 96, 80, 64
    a = np.asfortranarray(rng.standard_normal((k, m), dtype=np.float32))  # used transposed
    b = np.asfortranarray(rng.standard_normal((k, n), dtype=np.float32))
    c = np.zeros((m, n), dtype=np.float32, order="F")
    h = ctypes.c_void_p()
    assert blas.cublasCreate_v2(ctypes.byref(h)) == 0
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    fp = ctypes.POINTER(ctypes.c_float)

    def gemm() -> int:
        return int(blas.cublasSgemm_v2(h, 1, 0, m, n, k, ctypes.byref(one), a.ctypes.data_as(fp), k,
                                       b.ctypes.data_as(fp), k, ctypes.byref(zero),
                                       c.ctypes.data_as(fp), m))

    def timed() -> float:
        t0 = time.perf_counter()
        for _ in range(6):
            assert gemm() == 0
        assert cuda.cudaDeviceSynchronize() == 0
        return time.perf_counter() - t0

    assert gemm() == 0  # asynchronous: the result is there once the stream is synchronised
    assert cuda.cudaDeviceSynchronize() == 0
    np.testing.assert_allclose(c, a.T @ b, rtol=1e-4, atol=1e-4)
    plain = min(timed() for _ in range(3))
    faults.write_text("slow_rank 3 4.0\n")
    time.sleep(0.01)
    assert timed() > 2.5 * plain
    assert blas.cublasDestroy_v2(h) == 0


def test_iterations_read_while_a_rank_writes_skip_its_half_written_line(tmp_path: Path) -> None:
    """CI read a rank's output between two writes of one line ("it=.. t0=.." without t1) and
    failed with a KeyError: only newline-terminated lines are finished iterations."""
    job = _job(tmp_path, FakeJobSpec(world_size=1, iters=2, compute_ms=1.0))
    out = tmp_path / "rank0.out"
    out.write_text("it=0 t0=1 t1=2 t2=3\nit=1 t0=4")
    assert [t.it for t in job.iterations(0)] == [0]
    out.write_text("it=0 t0=1 t1=2 t2=3\nit=1 t0=4 t1=5 t2=6\n")
    assert [t.it for t in job.iterations(0)] == [0, 1]
    out.write_text("it=0 t0=1")
    assert job.iterations(0) == []
