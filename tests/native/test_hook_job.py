"""The hook preloaded into real multi-process runs of the fake-NCCL workload."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from greyhound import hookabi as H
from greyhound.fakejob import FakeJob, FakeJobSpec
from tests.native.helpers import bench_result, hook_lib, wait_for, wait_rings

DATA = (H.Op.ALLREDUCE, H.Op.SEND, H.Op.RECV)
# These tests read the rings after the job: the hook removes them at exit unless told to keep them.
KEEP = {"GREYHOUND_RING_KEEP": "1"}



def test_every_rank_records_its_calls_splits_and_p2p(native_build: Path, tmp_path: Path) -> None:
    spec = FakeJobSpec(world_size=4, iters=25, compute_ms=1, pp=2, bytes=4096, job_id="fields",
                       verbose=False)
    shm = tmp_path / "shm"
    with FakeJob(spec, workdir=tmp_path / "w", hook=hook_lib(native_build), shm_dir=shm,
                 env=KEEP) as job:
        assert job.wait(60) == [0, 0, 0, 0]
    recs = {}
    for path in H.list_rings(shm, "fields"):
        reader = H.RingReader(path)
        assert reader.header.pid > 0 and reader.header.host
        recs[reader.header.rank] = reader.poll()
        assert reader.lost == 0
        for out in ("out", "err"):  # the hook prints nothing
            assert (tmp_path / "w" / f"rank{reader.header.rank}.{out}").read_bytes() == b""
    assert sorted(recs) == [0, 1, 2, 3]
    members: dict[int, set[int]] = defaultdict(set)
    nranks: dict[int, int] = {}
    for rank, r in recs.items():
        ops = r["op"].tolist()
        assert ops.count(H.Op.COMM_INIT) == 1 and ops.count(H.Op.COMM_SPLIT) == 2
        assert ops.count(H.Op.ALLREDUCE) == spec.iters
        assert ops.count(H.Op.GROUP_START) == ops.count(H.Op.GROUP_END) == spec.iters
        for row in r[np.isin(r["op"], [H.Op.COMM_INIT, H.Op.COMM_SPLIT])]:
            members[int(row["comm_id"])].add(rank)
            nranks[int(row["comm_id"])] = int(row["nranks"])
        assert np.all(r["return_ns"] >= r["enter_ns"])
        ar = r[r["op"] == H.Op.ALLREDUCE]
        assert ar["seq"].tolist() == list(range(1, spec.iters + 1))
        assert np.all(ar["count"] == spec.bytes // 4) and np.all(ar["datatype"] == 7)
        p2p = r[np.isin(r["op"], [H.Op.SEND, H.Op.RECV])]
        assert len(p2p) == spec.iters and np.all(p2p["flags"] & H.Flag.IN_GROUP)
        assert np.all(p2p["group_id"] > 0)
    # world + dp pairs {0,2},{1,3} + pp pairs {0,1},{2,3}: ids agree across ranks exactly so.
    groups = sorted(sorted(m) for m in members.values())
    assert groups == [[0, 1], [0, 1, 2, 3], [0, 2], [1, 3], [2, 3]]
    assert all(nranks[c] == len(m) for c, m in members.items())
    # P2P: stage 0 sends to its pp peer, stage 1 receives; counters and records agree.
    for rank, r in recs.items():
        sends = r[r["op"] == H.Op.SEND]
        recvs = r[r["op"] == H.Op.RECV]
        if rank % 2 == 0:
            assert len(sends) == spec.iters and np.all(sends["peer"] == 1)
            assert sends["seq"].tolist() == list(range(1, spec.iters + 1))
        else:
            assert len(recvs) == spec.iters and np.all(recvs["peer"] == 0)


def test_comm_table_counters_and_overflow(native_build: Path, tmp_path: Path) -> None:
    spec = FakeJobSpec(world_size=2, iters=40, compute_ms=0.5, pp=2, bytes=64, job_id="ovf",
                       verbose=False)
    shm = tmp_path / "shm"
    job = FakeJob(spec, workdir=tmp_path / "w", hook=hook_lib(native_build), shm_dir=shm,
                  env={"GREYHOUND_RING_RECORDS": "32", **KEEP})
    with job:
        assert job.wait(60) == [0, 0]
    for path in H.list_rings(shm, "ovf"):
        reader = H.RingReader(path)
        assert reader.header.capacity == 32
        assert len(reader.poll()) == 32 and reader.lost > 0
        comms = reader.comms()
        pp = comms[(comms["parent_id"] != 0) & (comms["nranks"] == 2)][0]  # the pp split
        assert int(pp["calls_completed"]) == int(pp["calls_entered"]) > 0
        sent = int(pp["send_count"][: int(pp["npeers"])].sum())
        got = int(pp["recv_count"][: int(pp["npeers"])].sum())
        assert sent + got == spec.iters
        assert int(pp["state"]) == H.CommState.DESTROYED


def _single_rank_env(build: Path, shm: Path, job: str, tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", GH_ITERS="5", GH_COMPUTE_MS="0.1",
               GH_BYTES="256", GH_RDZV=str(tmp / "rdzv"), GREYHOUND_JOB_ID=job,
               GREYHOUND_SHM_DIR=str(shm), LD_PRELOAD=str(hook_lib(build)),
               LD_LIBRARY_PATH=str(build / "fake"), **KEEP)
    return env


@pytest.mark.parametrize("consumer", ["dlopen", "ctypes"])
def test_rtld_local_consumers_are_seen(native_build: Path, tmp_path: Path, consumer: str) -> None:
    shm = tmp_path / "shm"
    env = _single_rank_env(native_build, shm, consumer, tmp_path)
    lib = str(native_build / "libghworkload.so")
    if consumer == "dlopen":
        cmd = [str(native_build / "tests" / "dlopen_workload"), lib]
    else:
        code = ("import ctypes, os, sys; l = ctypes.CDLL(sys.argv[1], mode=os.RTLD_LOCAL);"
                "argv = (ctypes.c_char_p * 1)(b'w'); sys.exit(l.gh_workload_main(1, argv))")
        cmd = [sys.executable, "-c", code, lib]
    p = subprocess.run(cmd, env=env, capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr
    recs = H.RingReader(H.ring_path(shm, consumer, 0)).poll()
    assert (recs["op"] == H.Op.ALLREDUCE).sum() == 5


def test_profile_mode_gets_gpu_times_from_the_fake_cuda(native_build: Path, tmp_path: Path) -> None:
    spec = FakeJobSpec(world_size=2, iters=150, compute_ms=2, bytes=4096, job_id="prof",
                       verbose=False)
    shm = tmp_path / "shm"
    with FakeJob(spec, workdir=tmp_path / "w", hook=hook_lib(native_build), shm_dir=shm) as job:
        rings = wait_rings(shm, "prof", 2)
        readers = [H.RingReader(p, gpu_wait_ns=5_000_000_000) for p in rings]
        for r in readers:
            r.control().set_mode("profile")
        assert job.wait(60) == [0, 0]
    for reader in readers:
        recs = reader.poll()
        ar = recs[recs["op"] == H.Op.ALLREDUCE]
        prof = ar[(ar["flags"] & H.Flag.PROFILED) != 0]
        assert len(prof) > 50  # most calls after the switch
        assert np.all(prof["flags"] & H.Flag.GPU_DONE)
        start, end = prof["gpu_start_ns"].astype(np.int64), prof["gpu_end_ns"].astype(np.int64)
        assert np.all(end >= start) and np.all(start > 0)
        # GPU work starts after the host enqueued it (anchor error well under a millisecond).
        assert np.all(start >= prof["enter_ns"].astype(np.int64) - 1_000_000)
        assert np.all(start <= prof["return_ns"].astype(np.int64) + 1_000_000_000)


def test_pause_benchmark_resume_with_the_jobs_communicators(native_build: Path,
                                                            tmp_path: Path) -> None:
    spec = FakeJobSpec(world_size=2, iters=400, compute_ms=2, bytes=4096, job_id="pause")
    shm = tmp_path / "shm"
    with FakeJob(spec, workdir=tmp_path / "w", hook=hook_lib(native_build), shm_dir=shm) as job:
        rings = wait_rings(shm, "pause", 2)
        job.wait_iteration(0, 5, 30)
        readers = [H.RingReader(p) for p in rings]
        ctls = [r.control() for r in readers]
        world = int(readers[0].comms()["comm_id"][0])
        assert world == int(readers[1].comms()["comm_id"][0])
        # One target for both ranks, a few collectives ahead of the furthest one.
        target = max(int(r.comms()["last_seq_entered"][0]) for r in readers) + 3
        for c in ctls:
            c.pause(comm_id=world, seq=target)
        wait_for(lambda: all(c.paused() for c in ctls), 20, "ranks did not pause")
        for r in readers:
            assert int(r.comms()["last_seq_completed"][0]) == target - 1
        before = [len(job.iterations(r)) for r in range(2)]
        # The transfers run on a benchmark communicator both ranks split from the job's (a split
        # is collective: both are asked before either is waited for).
        splits = [c.submit(H.BenchRequest(kind=H.BenchKind.SPLIT, size=0, comm_id=world))
                  for c in ctls]
        assert all(bench_result(c, q).ok for c, q in zip(ctls, splits, strict=True))
        send = ctls[0].submit(H.BenchRequest(kind=H.BenchKind.SEND, size=1 << 20, repeat=3,
                                             comm_id=world, peer=1))
        recv = ctls[1].submit(H.BenchRequest(kind=H.BenchKind.RECV, size=1 << 20, repeat=3,
                                             comm_id=world, peer=0))
        gemm = ctls[0].submit(H.BenchRequest(kind=H.BenchKind.GEMM, size=32, repeat=2))
        results: dict[tuple[int, int], H.BenchResult] = {}  # request ids are per rank

        def done() -> bool:
            for key in ((0, send), (1, recv), (0, gemm)):
                if key not in results and (res := ctls[key[0]].result(key[1])) is not None:
                    results[key] = res
            return len(results) == 3

        wait_for(done, 30, "benchmarks did not finish")
        time.sleep(0.1)
        assert [len(job.iterations(r)) for r in range(2)] == before  # training really stopped
        for c in ctls:
            c.resume()
        assert job.wait(60) == [0, 0]
    assert results[0, send].ok and results[1, recv].ok, results
    assert len(results[0, send].durations_ns) == 3 and min(results[0, send].durations_ns) > 0
    assert len(results[1, recv].durations_ns) == 3
    assert results[0, gemm].ok and len(results[0, gemm].durations_ns) == 2
    for r in readers:
        recs = r.poll()
        assert (recs["op"] == H.Op.ALLREDUCE).sum() == spec.iters  # benchmarks are not recorded
        assert int(r.control_block()["pause_count"]) == 1
