"""A pause never outlives its lease, and a validation leaves nothing behind, in real runs of the
fake-NCCL job with the hook preloaded.

The requester here is a separate process that pauses both ranks and is then killed (SIGKILL),
as a validator or agent dying mid-validation would be: nobody resumes, and the job must go on
by itself when the lease ends and finish normally.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from greyhound import hookabi as H
from greyhound.fakejob import FakeJob, FakeJobSpec
from greyhound.hookabi.layout import BENCH_MAX_GEMM_N, BENCH_MAX_P2P_BYTES
from greyhound.hookabi.mapping import RingMapping
from tests.native.helpers import bench_result, hook_lib, pause_then_die, wait_for, wait_rings

LEASE_S = 3.0
INVALID_ARGUMENT = 4  # ncclInvalidArgument: what the hook answers a request beyond the bounds



def _world(reader: H.RingReader) -> int:
    return int(reader.comms()["comm_id"][0])


def _target(readers: list[H.RingReader]) -> int:
    """A collective a few steps beyond every rank's newest: both park at the same one."""
    return max(int(r.comms()["last_seq_entered"][0]) for r in readers) + 3


def test_a_job_paused_by_a_killed_requester_resumes_when_its_lease_ends(native_build: Path,
                                                                        tmp_path: Path) -> None:
    # Long enough for the pausing process to start up and park it on a loaded machine.
    spec = FakeJobSpec(world_size=2, iters=3000, compute_ms=1, bytes=4096, job_id="orphan")
    shm = tmp_path / "shm"
    with FakeJob(spec, workdir=tmp_path / "w", hook=hook_lib(native_build), shm_dir=shm) as job:
        rings = wait_rings(shm, "orphan", 2)
        job.wait_iteration(0, 5, 30)
        readers = [H.RingReader(p) for p in rings]
        ctls = [r.control() for r in readers]
        asked = time.monotonic()
        p = pause_then_die(rings, LEASE_S)
        assert p.returncode == -signal.SIGKILL and b"paused" in p.stdout, p.stderr
        assert all(c.paused() for c in ctls)  # parked, and the requester is gone
        ctl = [RingMapping(r.path).ctl for r in readers]
        wait_for(lambda: all(int(c["lease_expired"]) == 1 for c in ctl), LEASE_S + 30, "no resume")
        resumed = time.monotonic()
        assert job.wait(120) == [0, 0]  # the job finished normally
    assert LEASE_S - 0.2 <= resumed - asked <= LEASE_S + 30  # at the lease's end, not before
    for c in ctl:
        assert int(c["pause_count"]) == 1 and int(c["pause_request"]) == 0
        assert int(c["paused"]) == 0 and int(c["pause_lease_ns"]) == 0
    longest = max(t.total_ms for r in range(2) for t in job.iterations(r))
    assert longest >= (LEASE_S - 1.0) * 1e3  # the iteration that held the pause
    assert all(len(job.iterations(r)) == spec.iters for r in range(2))


def _mem_per_iteration(out: Path) -> list[int]:
    return [int(m.group(1)) for m in re.finditer(r"^it=\d+ .* mem=(\d+)$", out.read_text(), re.M)]


def _exit_memory(out: Path) -> dict[str, int]:
    m = re.search(r"^fake_cuda mem_allocs=(\d+) mem_bytes=(\d+) mem_peak_bytes=(\d+)$",
                  out.read_text(), re.M)
    assert m is not None, "the workload printed no memory line"
    return dict(zip(("allocs", "bytes", "peak"), map(int, m.groups()), strict=True))


def _raw_submit(ctl: np.ndarray, req_id: int, kind: H.BenchKind, size: int, repeat: int = 1) -> int:
    """A request written as a foreign agent could, past BenchRequest's checks."""
    slots = ctl["slots"]
    i = int(np.flatnonzero(slots["state"] == H.BenchState.EMPTY)[0])
    slots[i]["kind"], slots[i]["size"], slots[i]["repeat"] = int(kind), size, repeat
    slots[i]["req_id"] = req_id
    slots[i]["state"] = int(H.BenchState.SUBMITTED)
    return i


def test_validation_scratch_is_given_back_and_sizes_beyond_the_bounds_are_refused(
        native_build: Path, tmp_path: Path) -> None:
    spec = FakeJobSpec(world_size=2, iters=150, compute_ms=2, bytes=4096, job_id="scratch")
    shm, work = tmp_path / "shm", tmp_path / "w"
    gemm_n = 96
    with FakeJob(spec, workdir=work, hook=hook_lib(native_build), shm_dir=shm) as job:
        rings = wait_rings(shm, "scratch", 2)
        job.wait_iteration(0, 5, 30)
        readers = [H.RingReader(p) for p in rings]
        ctls = [r.control() for r in readers]
        world, target = _world(readers[0]), _target(readers)
        for c in ctls:
            c.pause(comm_id=world, seq=target, lease_s=60)
        wait_for(lambda: all(c.paused() for c in ctls), 30, "ranks did not pause")
        paused_at = len(job.iterations(0))
        raw = RingMapping(readers[0].path).ctl
        huge = [_raw_submit(raw, 1000, H.BenchKind.GEMM, BENCH_MAX_GEMM_N + 1),
                _raw_submit(raw, 1001, H.BenchKind.GEMM, 1 << 32),  # n*n*4 overflows 64 bits
                _raw_submit(raw, 1002, H.BenchKind.GEMM, 0),
                _raw_submit(raw, 1003, H.BenchKind.SEND, BENCH_MAX_P2P_BYTES + 1)]
        # As the validator does: transfers run on a benchmark communicator that every rank
        # splits from the job's first (a split is collective: both asked before either waited).
        splits = [c.submit(H.BenchRequest(kind=H.BenchKind.SPLIT, size=0, comm_id=world))
                  for c in ctls]
        assert all(bench_result(c, q).ok for c, q in zip(ctls, splits, strict=True))
        ids = [ctls[0].submit(H.BenchRequest(kind=H.BenchKind.GEMM, size=gemm_n, repeat=2)),
               ctls[0].submit(H.BenchRequest(kind=H.BenchKind.SEND, size=1 << 16, repeat=2,
                                             comm_id=world, peer=1)),
               ctls[1].submit(H.BenchRequest(kind=H.BenchKind.RECV, size=1 << 16, repeat=2,
                                             comm_id=world, peer=0))]
        wait_for(lambda: all(int(raw["slots"][i]["state"]) >= H.BenchState.DONE for i in huge), 30,
              "the hook did not answer the requests beyond the bounds")
        results: dict[int, H.BenchResult] = {}

        def done() -> bool:
            for k, (c, req) in enumerate(zip((ctls[0], ctls[0], ctls[1]), ids, strict=True)):
                if k not in results and (res := c.result(req)) is not None:
                    results[k] = res
            return len(results) == 3

        wait_for(done, 60, "benchmarks did not finish")
        for i in huge:
            assert int(raw["slots"][i]["state"]) == H.BenchState.FAILED
            assert int(raw["slots"][i]["result"]) == INVALID_ARGUMENT
        for c in ctls:
            c.resume()
        assert job.wait(120) == [0, 0]
    assert all(r.ok for r in results.values()), results
    mem = _mem_per_iteration(work / "rank0.out")
    assert len(mem) == spec.iters and not any(mem[:paused_at])  # the workload holds none
    assert not any(mem[paused_at + 3:])  # given back at resume: training runs on without it
    held = _exit_memory(work / "rank0.out")
    assert held["peak"] >= 3 * gemm_n * gemm_n * 4  # the GEMM's scratch did exist on the GPU
    assert held["bytes"] == 0 and held["allocs"] == 0
    assert _exit_memory(work / "rank1.out")["bytes"] == 0


def test_bench_requests_beyond_the_bounds_are_refused_where_they_are_built() -> None:
    for kind, size in ((H.BenchKind.GEMM, BENCH_MAX_GEMM_N + 1), (H.BenchKind.GEMM, 0),
                       (H.BenchKind.SEND, BENCH_MAX_P2P_BYTES + 1), (H.BenchKind.RECV, -1)):
        with pytest.raises(ValueError):
            H.BenchRequest(kind=kind, size=size)
    assert H.BenchRequest(kind=H.BenchKind.GEMM, size=BENCH_MAX_GEMM_N).size == BENCH_MAX_GEMM_N
