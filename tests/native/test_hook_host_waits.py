"""NCCL's host waits inside a call while the GPU idles: connection set-up at run time
(NCCL_RUNTIME_CONNECT, a collective's first use of an algorithm connects to its peers), bootstrap
exchanges, a stalled proxy thread; and every communicator init, split, shrink and destroy. Nothing
is pending on the GPU then, so the GPU completion marks alone never show such a wait: the hang
watch takes the larger of the GPU's pending age and the host's time inside the call, and the hook
reports lifecycle calls in flight like data calls (an init on an entry made before the call).

The fake's `host_stall R seq` blocks rank R's host inside its collective seq before anything is
enqueued."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import numpy as np

from greyhound import hookabi as H
from greyhound.core.job_hangs import COUNTER_FIELDS, HangFinding, JobHangMonitor
from greyhound.fakejob import FakeJob, FakeJobSpec
from services.agent.collector import Collector
from tests.native.helpers import hook_lib, wait_for, wait_rings


def _world(reader: H.RingReader) -> np.void:
    comms = reader.comms()
    entry: np.void = comms[comms["parent_id"] == 0][0]
    return entry


def _watch(col: Collector, mon: JobHangMonitor) -> list[HangFinding]:
    rows = col.counters(time.monotonic_ns())
    mon.observe_counters(time.time(), {f: getattr(rows, f) for f in COUNTER_FIELDS})
    return mon.check(time.time())


def test_hosts_blocked_inside_a_collective_with_their_gpus_idle_are_a_hang(native_build: Path,
                                                                           tmp_path: Path) -> None:
    spec = FakeJobSpec(world_size=2, iters=400, compute_ms=5, compute_busy=0.0, job_id="hstall",
                       verbose=False)
    shm = tmp_path / "shm"
    with FakeJob(spec, workdir=tmp_path / "w", hook=hook_lib(native_build), shm_dir=shm) as job:
        readers = [H.RingReader(p) for p in wait_rings(shm, "hstall", 2)]
        wait_for(lambda: all(int(_world(r)["gpu_calls_done"]) > 10 for r in readers), 30, "marks")
        at = max(int(_world(r)["last_seq_entered"]) for r in readers) + 10  # the hook's seq
        for rank in (0, 1):
            job.faults.set(f"host_stall {rank} {at - 1}")  # the fake numbers from 0
        wait_for(lambda: all(int(_world(r)["last_seq_entered"]) == at for r in readers), 30,
                 "the stalled call was not entered")
        time.sleep(1.5)
        rows = [_world(r) for r in readers]
        for row in rows:  # inside the call, on the host; nothing pending on the GPU
            assert int(row["gpu_marks"]) == 1 and int(row["gpu_pending_ns"]) == 0
            assert int(row["inflight_enter_ns"]) != 0
            assert int(row["gpu_calls_done"]) == int(row["calls_entered"]) - 1
        col = Collector(shm, "hstall")
        col.scan()
        (found,) = _watch(col, JobHangMonitor(floor_s=1.0))
        assert found.waiting_ranks == (0, 1) and found.basis == "gpu" and found.stalled_s > 1.0
        assert not found.setup
        col.close()
        job.faults.clear()
        wait_for(lambda: all(int(_world(r)["inflight_enter_ns"]) == 0 for r in readers), 30,
                 "the hosts did not leave the call")
        assert job.wait(60) == [0, 0]


def test_an_init_waiting_for_a_peer_is_in_flight_and_named(native_build: Path,
                                                           tmp_path: Path) -> None:
    """Rank 0 of a world of 2 whose rank 1 never comes: inside ncclCommInitRank for good. Its ring
    shows the communicator being made (its id, from the unique id), the init in flight, and the
    hang watch raises it once the set-up allowance has passed."""
    spec = FakeJobSpec(world_size=2, iters=10, compute_ms=1, job_id="initwait", verbose=False)
    shm = tmp_path / "shm"
    job = FakeJob(spec, workdir=tmp_path / "w", hook=hook_lib(native_build), shm_dir=shm)
    env = job.rank_env(0, native_build)
    proc = subprocess.Popen([str(native_build / "gh_workload")], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        (path,) = wait_rings(shm, "initwait", 1)
        reader = H.RingReader(path)
        wait_for(lambda: len(reader.comms()) == 1, 20, "no communicator being made")
        (row,) = reader.comms()
        assert int(row["state"]) == H.CommState.INIT and int(row["life_op"]) == H.Op.COMM_INIT
        assert (int(row["rank"]), int(row["nranks"])) == (0, 2) and int(row["comm_id"]) != 0
        assert int(row["inflight_enter_ns"]) != 0
        col = Collector(shm, "initwait")
        col.scan()
        mon = JobHangMonitor(floor_s=0.5, setup_floor_s=1.5)
        found: list[HangFinding] = []

        def raised() -> bool:
            found.extend(_watch(col, mon))
            return bool(found)

        wait_for(raised, 20, "no finding")
        (f,) = found
        assert f.comm_id == int(row["comm_id"]) and f.setup and f.threshold_s == 1.5
        assert f.waiting_ranks == (0,) and f.basis == "host"
        rows = col.counters(time.monotonic_ns())
        assert rows.last_op == [H.Op.COMM_INIT] and rows.inflight_s[0] >= 1.5
        col.close()
        reader.close()
    finally:
        proc.kill()
        proc.wait()
