"""The agent's ring reaper: rings no live process writes are removed once quiet for the grace
period; live ones (the hook's lock, or a live pid for rings written without it), symlinks and
files that changed hands are left alone; a real job's rings go at its normal exit by the hook's
own hand, and after a kill -9 by the reaper's."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

from greyhound import hookabi as H
from greyhound.fakejob import FakeJob, FakeJobSpec, native_build_dir
from services.agent.reaper import RingReaper
from tests.native.helpers import wait_rings


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                       text=True, check=True)
    return int(p.stdout)


def _ring(shm: Path, job: str, rank: int, pid: int) -> Path:
    path = H.ring_path(shm, job, rank)
    H.RingWriter(path, job=job, rank=rank, host="h", pid=pid, device=0, capacity=16).close()
    return path


def test_stale_rings_go_after_the_grace_period_and_live_ones_stay(tmp_path: Path) -> None:
    shm, clock = tmp_path / "shm", Clock()
    dead = _ring(shm, "j", 0, _dead_pid())
    live_pid = _ring(shm, "j", 1, os.getpid())  # no lock, but its process lives
    locked = _ring(shm, "j", 2, _dead_pid())
    temp = shm / "j" / ".rank-3.ring.00000000000000ab"  # a creation cut short: all zeros
    temp.write_bytes(bytes(8192))
    (shm / "j" / "rank-4.ring").symlink_to(dead)
    other = shm / "j" / "notes.txt"
    other.write_text("not a ring")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); "
        "fcntl.lockf(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)"),
        str(locked)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        reaper = RingReaper(shm, grace_s=60, clock=clock)
        assert reaper.sweep() == []  # first seen dead: the grace period starts
        clock.t += 59
        assert reaper.sweep() == []
        clock.t += 2
        assert sorted(reaper.sweep()) == sorted([dead, temp])
        assert live_pid.exists() and locked.exists() and other.exists()
        assert (shm / "j" / "rank-4.ring").is_symlink()
        holder.kill()
        holder.wait()
        assert reaper.sweep() == []  # unlocked now: its own grace period starts
        clock.t += 61
        assert reaper.sweep() == [locked] and reaper.removed == 3
    finally:
        holder.kill()
        holder.wait()


def test_a_ring_that_changes_restarts_its_grace_period(tmp_path: Path) -> None:
    shm, clock = tmp_path / "shm", Clock()
    ring = _ring(shm, "j", 0, _dead_pid())
    reaper = RingReaper(shm, grace_s=10, clock=clock)
    assert reaper.sweep() == []
    clock.t += 9
    with open(ring, "ab") as f:  # someone still writes it
        f.write(b"x")
    assert reaper.sweep() == []
    clock.t += 9
    assert reaper.sweep() == []
    clock.t += 2
    assert reaper.sweep() == [ring]


def test_a_file_that_took_the_name_meanwhile_is_put_back(tmp_path: Path) -> None:
    """The check after the rename: a restarted rank's new ring at the judged name survives."""
    shm = tmp_path / "shm"
    judged = _ring(shm, "j", 0, _dead_pid())
    st = judged.stat()
    newer = judged.with_name("new")
    newer.write_text("the restarted rank's ring")
    os.replace(newer, judged)
    assert not RingReaper(shm)._remove(judged, (st.st_dev, st.st_ino))
    assert judged.read_text() == "the restarted rank's ring"
    assert sorted(p.name for p in judged.parent.iterdir()) == ["rank-0.ring"]


def test_empty_job_directories_go_after_the_grace_period(tmp_path: Path) -> None:
    shm, clock = tmp_path / "shm", Clock()
    (shm / "gone").mkdir(parents=True)
    _ring(shm, "kept", 0, os.getpid())
    reaper = RingReaper(shm, grace_s=5, clock=clock)
    reaper.sweep()
    clock.t += 6
    reaper.sweep()
    assert sorted(p.name for p in shm.iterdir()) == ["kept"]


def test_a_real_job_leaves_no_ring_behind(tmp_path: Path) -> None:
    """Normal exit: the hook removes its rings. kill -9: they stay, unlocked, until the reaper
    removes them; while the job ran, the lock kept them whatever the grace period."""
    hook = native_build_dir() / "libgreyhound_hook.so"
    shm = tmp_path / "shm"
    spec = FakeJobSpec(world_size=2, iters=20, compute_ms=1, bytes=4096, job_id="done",
                       verbose=False)
    with FakeJob(spec, workdir=tmp_path / "a", hook=hook, shm_dir=shm) as job:
        wait_rings(shm, "done", 2)
        assert job.wait(60) == [0, 0]
    assert H.list_rings(shm, "done") == []

    clock = Clock()
    reaper = RingReaper(shm, grace_s=1, clock=clock)
    spec = FakeJobSpec(world_size=2, iters=100_000, compute_ms=2, bytes=4096, job_id="killed",
                       verbose=False)
    with FakeJob(spec, workdir=tmp_path / "b", hook=hook, shm_dir=shm) as job:
        rings = wait_rings(shm, "killed", 2)
        for _ in range(3):
            assert reaper.sweep() == []
            clock.t += 5
        assert all(_locked(p) for p in rings)
        job.kill()
    assert H.list_rings(shm, "killed") == rings
    deadline = time.monotonic() + 10  # the kernel drops the locks with the processes
    while any(_locked(p) for p in rings) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reaper.sweep() == []
    clock.t += 2
    assert sorted(reaper.sweep()) == rings
    assert H.list_rings(shm, "killed") == []


def _locked(path: Path) -> bool:
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False
