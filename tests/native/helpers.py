"""Shared helpers of the native tests."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from greyhound import hookabi as H

REPO = Path(__file__).resolve().parents[2]

# Pause every ring with a lease at one collective of the first communicator, a few beyond every
# rank's newest (computed here, once this process runs: its start-up takes a while), wait until
# parked, say so, die by SIGKILL: a validator or agent dying mid-validation, nobody left to resume.
_DYING_PAUSER = r"""
import os, signal, sys, time
from pathlib import Path
import numpy as np

from greyhound import hookabi as H
lease = float(sys.argv[1])
readers = [H.RingReader(Path(p)) for p in sys.argv[2:]]
comm = int(readers[0].comms()["comm_id"][0])
seq = max(int(r.comms()["last_seq_entered"][0]) for r in readers) + 3
ctls = [r.control() for r in readers]
for c in ctls:
    c.pause(comm_id=comm, seq=seq, lease_s=lease)
deadline = time.monotonic() + 30
while not all(c.paused() for c in ctls):
    if time.monotonic() > deadline:
        sys.exit(3)
    time.sleep(0.002)
print("paused", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def hook_lib(build: Path) -> Path:
    """The hook library of a native build."""
    return build / "libgreyhound_hook.so"


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``cond`` every 5 ms until it holds; ``TimeoutError(what)`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.005)
    raise TimeoutError(what)


def wait_rings(shm: Path, job: str, n: int, timeout: float = 20.0) -> list[Path]:
    """The job's n ring files, once the hook in each rank has created its own."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rings = H.list_rings(shm, job)
        if len(rings) == n:
            return rings
        time.sleep(0.02)
    raise TimeoutError(f"{n} rings for {job} did not appear")


def pause_then_die(rings: list[Path], lease_s: float) -> subprocess.CompletedProcess[bytes]:
    """Another process parks the ranks of ``rings`` with a lease of lease_s (a targeted pause,
    as the validator's), and is killed (SIGKILL) once they are parked."""
    return subprocess.run([sys.executable, "-c", _DYING_PAUSER, str(lease_s), *map(str, rings)],
                          capture_output=True, timeout=60, cwd=REPO)


def world_entry(reader: H.RingReader) -> np.void:
    """The job communicator's entry (the workload's first; with tp = pp = 1 also the DP one)."""
    comms = reader.comms()
    entry: np.void = comms[(comms["parent_id"] == 0) & (comms["state"] == H.CommState.ACTIVE)][0]
    return entry


def bench_result(ctl: H.Control, req: int, timeout: float = 30.0) -> H.BenchResult:
    """The final result of benchmark request ``req``, waited for."""
    out: list[H.BenchResult] = []

    def done() -> bool:
        res = ctl.result(req)
        if res is not None:
            out.append(res)
        return bool(out)

    wait_for(done, timeout, "benchmark did not finish")
    return out[0]
