"""A process with no shared CUDA runtime: nvcc links the runtime statically by default, and some
programs use the driver API alone. The hook finds no libcudart there, only the driver every CUDA
process loads (libcuda.so.1), and must keep its GPU view through it: completion marks, profile
times, the device's PCI bus id; and where there is no CUDA at all, say so in the ring header so
that the agent can tell everyone the rank's GPU view is off.

gh_workload_static is the fake workload with the fake runtime compiled in: its process maps the
fake driver and no libcudart (the fake driver insists on cuInit and a current context, as CUDA
does)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from greyhound import hookabi as H
from greyhound.core.job_hangs import COUNTER_FIELDS, JobHangMonitor
from greyhound.fakejob import FakeJob, FakeJobSpec
from services.agent.collector import Collector
from tests.native.helpers import hook_lib, wait_for, wait_rings


def _world(reader: H.RingReader) -> np.void:
    """The job communicator's row; a zero row while it is still being made."""
    comms = reader.comms()
    live = comms[comms["state"] == H.CommState.ACTIVE]
    entry: np.void = live[0] if len(live) else np.zeros((), H.COMM_DTYPE)[()]
    return entry


def test_a_static_runtime_process_keeps_marks_and_a_gpu_hang_shows(native_build: Path,
                                                                     tmp_path: Path) -> None:
    spec = FakeJobSpec(world_size=2, iters=400, compute_ms=5, compute_busy=0.0, job_id="static",
                       workload="gh_workload_static", verbose=False)
    shm = tmp_path / "shm"
    maps = []
    with FakeJob(spec, workdir=tmp_path / "w", hook=hook_lib(native_build), shm_dir=shm) as job:
        readers = [H.RingReader(p) for p in wait_rings(shm, "static", 2)]
        maps = [Path(f"/proc/{p.pid}/maps").read_text() for p in job.procs]
        wait_for(lambda: all(int(_world(r)["gpu_calls_done"]) > 10 for r in readers), 30,
                 "no GPU completion marks in a process without libcudart")
        for r in readers:
            h = r.refresh_header()
            assert h.gpu_api == H.GpuApi.DRIVER and not h.marks_off
        # the device's identity, as the driver names it (the fake job runs rank r on GPU r)
        assert [r.header.pci_bus_id for r in readers] == ["0000:18:00.0", "0000:29:00.0"]
        hung = int(_world(readers[1])["last_seq_entered"]) + 15
        job.faults.set(f"never_complete 1 {hung - 1}")  # the fake numbers collectives from 0
        wait_for(lambda: int(_world(readers[1])["gpu_pending_seq"]) == hung, 30, "no pending call")
        time.sleep(1.2)
        row = _world(readers[1])
        assert int(row["inflight_enter_ns"]) == 0  # the host left NCCL long ago
        assert time.monotonic_ns() - int(row["gpu_pending_ns"]) > 1_000_000_000
        # what the tracker's hang watch makes of the agent's sample
        col = Collector(shm, "static")
        col.scan()
        rows = col.counters(time.monotonic_ns())
        mon = JobHangMonitor(floor_s=1.0)
        mon.observe_counters(time.time(), {f: getattr(rows, f) for f in COUNTER_FIELDS})
        (found,) = mon.check(time.time())
        assert found.basis == "gpu" and 1 in found.waiting_ranks and found.marks_off == ()
        col.close()
        job.faults.clear()
        wait_for(lambda: int(_world(readers[1])["gpu_seq_done"]) > hung, 30, "did not recover")
        assert job.wait(60) == [0, 0]
    assert all("libcudart" not in m and "fake/libcuda.so.1" in m for m in maps)
