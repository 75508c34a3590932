"""The README's main job: a small fake-NCCL training job, one rank slowed mid-run, found end to end.

Real parts all the way: the native hook preloaded into 4 workload processes over the fake NCCL,
the node agent draining their rings, NATS JetStream, the tracker's BOCD+V, the analyzer writing
the incident to Postgres, and the REST API returning it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from greyhound.fakejob import FakeJob, FakeJobSpec, native_build_dir
from services.common.settings import Settings
from services.validator.settings import for_cpu_fake
from stack.up import Stack, wait_api


def find_incident(base: str, job: str) -> dict[str, object] | None:
    r = httpx.get(f"{base}/v1/incidents", params={"job_id": job}, timeout=5.0)
    r.raise_for_status()
    rows: list[dict[str, object]] = r.json()
    return rows[0] if rows else None


def wait_localized(base: str, job: str, first: dict[str, object],
                   timeout_s: float) -> dict[str, object]:
    """The incident once localised (and validated, if that follows soon), else as it stands."""
    deadline = time.monotonic() + timeout_s
    latest = first
    while time.monotonic() < deadline:
        latest = find_incident(base, job) or latest
        if latest.get("status") in ("validated", "resolved"):
            break
        time.sleep(0.5)
    return latest


def run_demo(settings: Settings, *, ranks: int = 4, slow_rank: int = 2, factor: float = 1.5,
             slow_from: int = 100, port: int | None = None, compute_ms: float = 40.0,
             timeout_s: float = 60.0) -> int:
    if not 0 <= slow_rank < ranks:
        raise SystemExit(f"--slow-rank must be in [0, {ranks}), got {slow_rank}")
    if factor <= 1.0:
        raise SystemExit(f"--factor must be > 1, got {factor}")
    # The demo reads its incident over REST on loopback without a token.
    settings = settings.model_copy(update={"api_anonymous_role": "viewer"})
    port = port or settings.api_port
    base = f"http://127.0.0.1:{port}"
    job = f"demo-{uuid.uuid4().hex[:8]}"
    print("building native/ (hook, fake NCCL, workload) ...", flush=True)
    build = native_build_dir()
    print(f"starting embedded NATS + Postgres and the services (data in {settings.data_dir}) ...",
          flush=True)
    work = Path(tempfile.mkdtemp(prefix="gh-demo-"))
    try:
        # The fake NCCL's GPU is a CPU: validation sizes for it, unless the operator chose others.
        with Stack(settings, port=port, service_settings=(for_cpu_fake(),)) as stack:
            wait_api(base)
            print(f"API up at {base}; launching job {job}: {ranks} ranks, rank {slow_rank} "
                  f"{factor}x slower from iteration {slow_from}", flush=True)
            spec = FakeJobSpec(world_size=ranks, iters=slow_from + 400, compute_ms=compute_ms,
                               job_id=job, compute_busy=0.1)
            with FakeJob(spec, workdir=work, hook=build / "libgreyhound_hook.so",
                         shm_dir=Path(settings.shm_dir)) as fj:
                fj.wait_iteration(slow_rank, slow_from, timeout=timeout_s)
                fj.faults.set(f"slow_rank {slow_rank} {factor}")
                t_slow = time.monotonic()
                print(f"iteration {slow_from}: rank {slow_rank} is now {factor}x slower; "
                      "waiting for the incident ...", flush=True)
                incident = None
                while incident is None and time.monotonic() - t_slow < timeout_s:
                    if stack.dead():
                        print(f"service(s) died: {stack.dead()}; see {settings.data_dir}/logs")
                        return 1
                    incident = find_incident(base, job)
                    if incident is None:
                        time.sleep(0.25)
                elapsed = time.monotonic() - t_slow
                if incident is None:
                    print(f"no incident within {timeout_s}s of the slowdown: FAILED")
                    return 1
                print(f"incident opened {elapsed:.1f}s after the slowdown began; waiting for the "
                      "analyzer and validator to name the culprit ...", flush=True)
                incident = wait_localized(base, job, incident, timeout_s=30.0)
            print(f"incident after {time.monotonic() - t_slow:.1f}s:")
            print(json.dumps(incident, indent=2, default=str))
            return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(Path(settings.shm_dir) / job, ignore_errors=True)
