"""End to end on real parts: hook + fake NCCL (4 processes) -> agent -> NATS -> tracker ->
analyzer -> Postgres -> REST API. Rank 2 turns 1.5x slower at iteration 100; the incident must be
served within 10 s. A healthy run of the same length must produce none."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from greyhound.demo import find_incident, wait_api
from greyhound.fakejob import FakeJob, FakeJobSpec, native_build_dir
from greyhound.stack import Stack
from services.common.settings import Settings

ITERS = 260
COMPUTE_MS = 40.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def stack(nats_url: str, pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("e2e")
    settings = Settings(nats_url=nats_url, database_url=pg_url, data_dir=root / "data",
                        shm_dir=root / "shm")
    port = _free_port()
    with Stack(settings, port=port) as st:
        wait_api(f"http://127.0.0.1:{port}")
        yield st


def _job(stack: Stack, tmp: Path, job: str) -> FakeJob:
    spec = FakeJobSpec(world_size=4, iters=ITERS, compute_ms=COMPUTE_MS, job_id=job,
                       compute_busy=0.1)
    return FakeJob(spec, workdir=tmp, hook=native_build_dir() / "libgreyhound_hook.so",
                   shm_dir=Path(stack.settings.shm_dir))


def test_slow_rank_incident_within_10s(stack: Stack, tmp_path: Path) -> None:
    base = f"http://127.0.0.1:{stack.port}"
    job = f"slow-{uuid.uuid4().hex[:6]}"
    with _job(stack, tmp_path, job) as fj:
        fj.wait_iteration(2, 100, timeout=60)
        fj.faults.set("slow_rank 2 1.5")
        t0 = time.monotonic()
        incident = None
        while incident is None and time.monotonic() - t0 < 30:
            assert not stack.dead(), f"services died: {stack.dead()}"
            incident = find_incident(base, job)
            time.sleep(0.2)
        elapsed = time.monotonic() - t0
    assert incident is not None, "no incident within 30 s"
    assert elapsed <= 10.0, f"incident after {elapsed:.1f}s"
    assert incident["job_id"] == job
    assert incident["kind"] == "slowdown"
    assert incident["status"] in ("detected", "localized", "validated")
    assert 1.2 <= float(incident["severity"]) <= 1.8
    detail = httpx.get(f"{base}/v1/incidents/{incident['id']}", timeout=5).json()
    assert detail["timeline"][0]["stage"] == "detected"
    job_info = httpx.get(f"{base}/v1/jobs/{job}", timeout=5).json()
    assert sorted(r["rank"] for r in job_info["ranks"]) == [0, 1, 2, 3]


def test_healthy_run_of_same_length_has_no_incident(stack: Stack, tmp_path: Path) -> None:
    base = f"http://127.0.0.1:{stack.port}"
    job = f"healthy-{uuid.uuid4().hex[:6]}"
    with _job(stack, tmp_path, job) as fj:
        assert fj.wait(timeout=120) == [0, 0, 0, 0]
    time.sleep(3.0)  # let the agent, tracker and analyzer drain
    assert httpx.get(f"{base}/v1/jobs/{job}", timeout=5).status_code == 200
    assert find_incident(base, job) is None


def test_unknown_incident_is_404(stack: Stack) -> None:
    r = httpx.get(f"http://127.0.0.1:{stack.port}/v1/incidents/nope", timeout=5)
    assert r.status_code == 404 and "not found" in r.json()["detail"]
