"""``greyhound up`` on the authenticated embedded NATS, end to end: every service runs as its own
bus user with its registry line's permissions, and a slow rank of a fake-NCCL job is detected,
localised and validated (the validator's pause and benchmarks on the job) without the server
refusing a single message: its log records every permission violation, and it records none.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from greyhound.fakejob import FakeJob, FakeJobSpec, native_build_dir
from services.api.settings import ApiSettings
from services.common.settings import Settings
from services.tracker.settings import TrackerSettings
from services.validator.settings import for_cpu_fake
from stack.up import Stack, wait_api
from tests.conftest import TEST_TOKEN_KEY


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _incident(base: str, job: str) -> dict[str, Any] | None:
    rows: list[dict[str, Any]] = httpx.get(f"{base}/v1/incidents", params={"job_id": job},
                                           timeout=5).json()
    return rows[0] if rows else None


def test_the_whole_stack_runs_on_its_own_users(pg_url: str, tmp_path: Path) -> None:
    data = tmp_path / "data"
    # No nats_url: the embedded one, with users.
    settings = Settings(database_url=pg_url, token_key=TEST_TOKEN_KEY, data_dir=data,
                        shm_dir=tmp_path / "shm")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    job = f"auth-{uuid.uuid4().hex[:6]}"
    spec = FakeJobSpec(world_size=4, iters=420, compute_ms=40.0, job_id=job, compute_busy=0.1)
    latest: dict[str, Any] | None = None
    with Stack(settings, port=port, service_settings=(
            for_cpu_fake(), TrackerSettings(hang_floor_s=2.0),
            ApiSettings(api_anonymous_role="viewer"))) as stack:
        wait_api(base)
        users = json.loads((data / "nats" / "users.json").read_text())
        assert set(stack.services) - {"agent"} <= set(users)
        assert any(u.startswith("agent-") for u in users)  # added for the agent, then reloaded
        with FakeJob(spec, workdir=tmp_path / "w", hook=native_build_dir() / "libgreyhound_hook.so",
                     shm_dir=Path(settings.shm_dir)) as fj:
            fj.wait_iteration(2, 100, timeout=90)
            fj.faults.set("slow_rank 2 1.5")
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                assert not stack.dead(), f"services died: {stack.dead()}"
                latest = _incident(base, job)
                if latest is not None and latest["status"] in ("validated", "resolved") \
                        and "validation" in (latest.get("evidence") or {}):
                    break
                time.sleep(0.5)
            fj.faults.clear()
            assert fj.wait(timeout=120) == [0, 0, 0, 0]  # paused, resumed, finished
        log = (data / "nats" / "server.log").read_text()
    violations = [ln for ln in log.splitlines() if "Violation" in ln]
    assert violations == [], violations[:5]
    assert latest is not None, "no incident"
    stages = [e["stage"] for e in latest.get("timeline") or []]
    validation = (latest.get("evidence") or {}).get("validation", {})
    assert "localized" in stages and "verdict" in validation, latest
    assert validation["pause_s"] > 0  # the job was held for the benchmarks, then let go
