"""Reporting the job's collective timeout to the hook: the environment always, this process's
ring when it exists (and is its own), and the timeout read off a process group's backend."""

from __future__ import annotations

import os
import sys
import types
from datetime import timedelta
from pathlib import Path

import pytest

from greyhound import hookabi as H
from greyhound.integrations.pg_timeout import (
    ENV,
    own_ring,
    process_group_timeout,
    report_pg_timeout,
)


def _ring(shm: Path, pid: int) -> Path:
    path = H.ring_path(shm, "job", 3)
    H.RingWriter(path, job="job", rank=3, host="h", pid=pid, device=0, capacity=16)
    return path


def test_the_timeout_goes_to_the_environment_and_into_this_process_ring(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "0")  # registers the undo: the code under test sets it directly
    monkeypatch.delenv(ENV)
    monkeypatch.setenv("GREYHOUND_SHM_DIR", str(tmp_path))
    monkeypatch.setenv("GREYHOUND_JOB_ID", "job")
    monkeypatch.setenv("RANK", "3")
    assert own_ring() == H.ring_path(tmp_path, "job", 3)
    assert report_pg_timeout(timedelta(minutes=5)) is False  # no ring yet: the hook reads the env
    assert os.environ[ENV] == "300"
    ring = _ring(tmp_path, os.getpid())
    assert report_pg_timeout(20.0) is True
    assert os.environ[ENV] == "20"
    reader = H.RingReader(ring)
    assert reader.control().job_timeout_s() == 20.0
    reader.close()


def test_another_process_ring_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    monkeypatch.setenv(ENV, "0")  # registers the undo: the code under test sets it directly
    monkeypatch.delenv(ENV)
    ring = _ring(tmp_path, os.getpid() + 1)
    assert report_pg_timeout(7.5, ring=ring) is False
    reader = H.RingReader(ring)
    assert reader.control().job_timeout_s() is None
    reader.close()
    with pytest.raises(ValueError, match="cannot be reported"):
        report_pg_timeout(0)
    assert own_ring({"GREYHOUND_SHM_DIR": "/x"}) is None  # no rank: nothing to name


def test_the_timeout_is_read_off_the_groups_nccl_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in for torch (none in the CPU test environment): ProcessGroup._get_backend(device)
    returns the NCCL backend, whose options carry _timeout (a timedelta)."""
    torch = types.ModuleType("torch")
    torch.device = lambda name: name  # type: ignore[attr-defined]
    dist = types.ModuleType("torch.distributed")
    c10d = types.SimpleNamespace()
    dist.distributed_c10d = c10d  # type: ignore[attr-defined]
    torch.distributed = dist  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.distributed", dist)

    class Backend:
        options = types.SimpleNamespace(_timeout=timedelta(seconds=20))

    class Group:
        def _get_backend(self, device: str) -> Backend:
            assert device == "cuda"
            return Backend()

    c10d._get_default_group = Group
    assert process_group_timeout() == timedelta(seconds=20)
    assert process_group_timeout(types.SimpleNamespace(
        options=types.SimpleNamespace(_timeout=timedelta(minutes=10)))) == timedelta(minutes=10)
    with pytest.raises(LookupError, match="pass it to report_pg_timeout"):
        process_group_timeout(types.SimpleNamespace())
