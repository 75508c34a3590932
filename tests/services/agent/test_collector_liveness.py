"""A rank whose process died is retired: its last call would otherwise look stuck in NCCL for
ever, and a crashed job (a fail-stop) would be reported as a hang."""

from __future__ import annotations

import time
from pathlib import Path

from greyhound.fakejob import FakeJob, FakeJobSpec, native_build_dir
from services.agent.collector import Collector


def test_dead_ranks_stop_reporting_counters(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    spec = FakeJobSpec(world_size=2, iters=100_000, compute_ms=5.0, job_id="liveness")
    col = Collector(shm, spec.job_id)
    with FakeJob(spec, workdir=tmp_path / "job", hook=native_build_dir() / "libgreyhound_hook.so",
                 shm_dir=shm) as job:
        job.wait_iteration(0, 20, timeout=30)
        assert len(col.scan()) == 2
        col.drain()
        assert sorted(set(col.counters(time.monotonic_ns()).rank)) == [0, 1]
        job.kill()
    assert col.scan() == []
    assert all(s.ended for s in col.streams.values())
    col.drain()  # what was left is still read
    assert col.counters(time.monotonic_ns()).rank == []
