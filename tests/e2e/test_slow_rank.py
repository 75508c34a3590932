"""End to end on real parts: hook + fake NCCL (4 processes) -> agent -> NATS -> tracker ->
analyzer -> Postgres -> REST API. Rank 2 turns 1.5x slower at iteration 100; the incident must be
served within 10 s. A healthy run of the same length must produce none."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import httpx

from stack.up import Stack
from tests.e2e.conftest import fake_job, incidents, wait_incident


def test_slow_rank_incident_within_10s(stack: Stack, tmp_path: Path) -> None:
    base = f"http://127.0.0.1:{stack.port}"
    job = f"slow-{uuid.uuid4().hex[:6]}"
    with fake_job(stack, tmp_path, job) as fj:
        fj.wait_iteration(2, 100, timeout=60)
        fj.faults.set("slow_rank 2 1.5")
        incident, elapsed = wait_incident(stack, job, timeout_s=30)
    assert incident is not None, "no incident within 30 s"
    assert elapsed <= 10.0, f"incident after {elapsed:.1f}s"
    assert incident["job_id"] == job
    assert incident["kind"] in ("slowdown", "compute_slow", "mixed_slow")
    # The GPU is 1.5x slower; the iteration time also carries host contention on a loaded
    # 2-core machine (1.87 seen there), so the upper bound only rejects a gross misreading.
    assert 1.2 <= float(incident["severity"]) <= 2.5
    detail = httpx.get(f"{base}/v1/incidents/{incident['id']}", timeout=5).json()
    assert detail["timeline"][0]["stage"] == "detected"
    job_info = httpx.get(f"{base}/v1/jobs/{job}", timeout=5).json()
    assert sorted(r["rank"] for r in job_info["ranks"]) == [0, 1, 2, 3]


def test_healthy_run_of_same_length_has_no_incident(stack: Stack, tmp_path: Path) -> None:
    base = f"http://127.0.0.1:{stack.port}"
    job = f"healthy-{uuid.uuid4().hex[:6]}"
    with fake_job(stack, tmp_path, job) as fj:
        assert fj.wait(timeout=120) == [0, 0, 0, 0]
    time.sleep(3.0)  # let the agent, tracker and analyzer drain
    assert httpx.get(f"{base}/v1/jobs/{job}", timeout=5).status_code == 200
    assert incidents(stack, job) == []


def test_unknown_incident_is_404(stack: Stack) -> None:
    r = httpx.get(f"http://127.0.0.1:{stack.port}/v1/incidents/nope", timeout=5)
    assert r.status_code == 404 and "not found" in r.json()["detail"]
