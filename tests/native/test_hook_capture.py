"""Profile mode meets a CUDA graph capture (the fake CUDA's `capture R` fault).

While a rank's training stream captures a graph, the hook must record no events on it (they
would become graph nodes, not timings) and flag its records CAPTURED; its poller, which keeps
querying events recorded before the capture, must have switched itself to thread-local capture
mode, or those queries are illegal (the fake counts them and fails them, as CUDA does). The
completion marks skip the captured calls too (counted in gpu_marks_lost) and resume after.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from greyhound import hookabi as H
from greyhound.fakejob import FakeJob, FakeJobSpec
from tests.native.helpers import wait_rings


# gh_workload_static: a process with the CUDA runtime linked statically, where the hook works
# through the driver API (cuStreamIsCapturing, cuEventRecord, cuThreadExchangeStreamCaptureMode).
@pytest.mark.parametrize("workload", ["gh_workload", "gh_workload_static"])
def test_capture_flags_records_and_the_poller_stays_legal(native_build: Path, tmp_path: Path,
                                                          workload: str) -> None:
    spec = FakeJobSpec(world_size=2, iters=240, compute_ms=2, bytes=4096, job_id="capture",
                       workload=workload)
    shm = tmp_path / "shm"
    hook = native_build / "libgreyhound_hook.so"
    with FakeJob(spec, workdir=tmp_path / "w", hook=hook, shm_dir=shm) as job:
        readers = [H.RingReader(p, gpu_wait_ns=0) for p in wait_rings(shm, "capture", 2)]
        # Rank 0's events complete 30 ms late, so some are still pending when the capture starts
        # and the poller queries them during it.
        job.faults.set("gpu_lag_ms 0 30")
        for r in readers:
            r.control().set_mode("profile")
        job.wait_iteration(0, 60, 30)
        job.faults.set("capture 0")
        job.wait_iteration(0, 140, 30)
        job.faults.clear()
        assert job.wait(60) == [0, 0]
    out0 = (tmp_path / "w" / "rank0.out").read_text()
    assert "fake_cuda capture_violations=0 captured_event_records=0" in out0, out0[-300:]

    recs = readers[0].poll()
    ar = recs[recs["op"] == H.Op.ALLREDUCE]
    flags = ar["flags"]
    captured = ar[(flags & H.Flag.CAPTURED) != 0]
    assert len(captured) > 30
    assert not np.any(captured["flags"] & (H.Flag.PROFILED | H.Flag.GPU_DONE | H.Flag.GPU_LOST))
    assert np.all(captured["gpu_start_ns"] == 0) and np.all(captured["gpu_end_ns"] == 0)
    # Profiled before and after the capture, and every query of the poller was legal.
    profiled = ar[(flags & H.Flag.PROFILED) != 0]
    seq_captured = captured["seq"].astype(np.int64)
    seq_profiled = profiled["seq"].astype(np.int64)
    assert (seq_profiled < seq_captured.min()).sum() > 20
    assert (seq_profiled > seq_captured.max()).sum() > 50
    assert not np.any(flags & H.Flag.GPU_LOST)
    done = (profiled["flags"] & H.Flag.GPU_DONE) != 0
    assert (~done).sum() <= 3  # at most the last calls before the process exited
    assert np.all(profiled["gpu_end_ns"][done] >= profiled["gpu_start_ns"][done])

    other = readers[1].poll()
    assert not np.any(other["flags"] & H.Flag.CAPTURED)
    assert ((other["flags"] & H.Flag.GPU_DONE) != 0).sum() > 150

    # Completion marks: none for the captured calls (no event went into the capture, see the
    # fake's count above), and they kept completing once the capture ended.
    for reader, lost in ((readers[0], len(captured)), (readers[1], 0)):
        world = reader.comms()[0]
        assert int(world["gpu_marks"]) == 1
        assert lost <= int(world["gpu_marks_lost"]) <= lost + 3
        assert int(world["gpu_calls_done"]) >= int(world["calls_entered"]) - 1
