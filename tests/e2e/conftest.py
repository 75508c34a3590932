"""One running stack (tracker, analyzer, api, agent as processes) shared by the e2e tests."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from greyhound.fakejob import FakeJob, FakeJobSpec, native_build_dir
from services.agent.settings import AgentSettings
from services.api.settings import ApiSettings
from services.common.settings import Settings
from services.tracker.settings import TrackerSettings
from services.validator.settings import for_cpu_fake
from stack.up import Stack, wait_api
from tests.conftest import TEST_TOKEN_KEY

HANG_FLOOR_S = 2.0
GPU_DIR = "gpu"  # under the stack's root: the workdir whose fault file the agent's fake NVML reads


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="package")
def stack(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """As ``greyhound up`` runs it: no NATS URL, so the embedded one in the data directory, each
    service with its own bus user."""
    root = tmp_path_factory.mktemp("e2e")
    settings = Settings(database_url=pg_url, token_key=TEST_TOKEN_KEY, data_dir=root / "data",
                        shm_dir=root / "shm")
    port = _free_port()
    # The agent loads the fake NVML, which reads <root>/gpu/faults.txt: jobs run in that workdir
    # (gpu_workdir) share their fault file with the agent's GPUs.
    agent = AgentSettings(nvml_lib=str(native_build_dir() / "fake" / "libnvidia-ml.so.1"),
                          gpu_s=1.0, xid_poll_s=0.2)
    old = os.environ.get("FAKE_NCCL_FAULTS")

    def restore() -> None:
        if old is None:
            os.environ.pop("FAKE_NCCL_FAULTS", None)
        else:
            os.environ["FAKE_NCCL_FAULTS"] = old

    os.environ["FAKE_NCCL_FAULTS"] = str(root / GPU_DIR / "faults.txt")  # the children's copy
    try:
        with Stack(settings, port=port, service_settings=(
                for_cpu_fake(), TrackerSettings(hang_floor_s=HANG_FLOOR_S), agent,
                ApiSettings(api_anonymous_role="viewer"))) as st:
            restore()
            wait_api(f"http://127.0.0.1:{port}")
            yield st
    finally:
        restore()


def gpu_workdir(stack: Stack) -> Path:
    """The workdir whose faults.txt the stack agent's fake NVML reads (one job at a time)."""
    return Path(stack.settings.data_dir).parent / GPU_DIR


def fake_job(stack: Stack, workdir: Path, job: str, **spec: Any) -> FakeJob:
    params: dict[str, Any] = {"world_size": 4, "iters": 260, "compute_ms": 40.0,
                              "compute_busy": 0.1}
    params.update(spec)
    return FakeJob(FakeJobSpec(job_id=job, **params), workdir=workdir,
                   hook=native_build_dir() / "libgreyhound_hook.so",
                   shm_dir=Path(stack.settings.shm_dir))


def incidents(stack: Stack, job: str) -> list[dict[str, Any]]:
    r = httpx.get(f"http://127.0.0.1:{stack.port}/v1/incidents", params={"job_id": job},
                  timeout=5)
    r.raise_for_status()
    rows: list[dict[str, Any]] = r.json()
    return rows


def wait_incident(stack: Stack, job: str, timeout_s: float,
                  kind_prefix: str = "") -> tuple[dict[str, Any] | None, float]:
    """The job's first incident whose kind starts with kind_prefix, and the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        assert not stack.dead(), f"services died: {stack.dead()}"
        rows = [r for r in incidents(stack, job) if r["kind"].startswith(kind_prefix)]
        if rows:
            return rows[-1], time.monotonic() - t0
        time.sleep(0.1)
    return None, time.monotonic() - t0
