"""The whole stack stopped while a job runs and started again on the same data directory, as an
upgrade or a reboot does it, on the authenticated embedded NATS that ``greyhound up`` runs:

* by SIGTERM: every service shuts down cleanly (the tracker saves each job's state);
* by kill -9 of every process at once, the services and the nats-server: nothing runs its
  shutdown, the tracker's state is as old as its last periodic save.

After each restart the job that ran through it slows down and its slowdown is found: an incident
opened after the fault, localised to the slow rank (the tracker resumes the job from its saved
state, read back from the object store; a brief incident a loaded machine's jitter opened before
does not count). A job started after the restart is tracked within seconds (nothing the old job
left holds it up). Then two
simulator runs back to back in one data directory, the first ending with telemetry its tracker
had not consumed: the second run's fault is found.

These failed on the authenticated bus: the tracker could not read a saved state back (nats-py
looks the bucket's stream up, a request the tracker's user was refused), the refusal surfaced as
a timeout, and every message of the resumed job timed out in turn, retried as transient, holding
up every job behind it. No test had restarted the stack on the data directory it left.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from greyhound.sim.live import LiveSimulation
from services.api.settings import ApiSettings
from services.common.settings import Settings
from services.tracker.settings import TrackerSettings
from services.validator.settings import for_cpu_fake
from stack.sim_live import run_live
from stack.up import Stack, wait_api
from tests.conftest import TEST_TOKEN_KEY, new_database
from tests.e2e.conftest import fake_job
from tests.services.notifier.receiver import free_port
from tests.sim.helpers import job as job_shape
from tests.sim.helpers import scenario

# A new job is in the API once the agent found its rings and the tracker recorded its hello:
# about a second on an idle machine (the agent scans every 0.5 s). The bound allows a loaded
# 2-core machine ten times that and more; a tracker held up behind an old job's messages takes
# 5 s per message it cannot handle, hundreds of them.
TRACKED_WITHIN_S = 20.0
FOUND_WITHIN_S = 90.0  # the slowdown detected: tens of iterations after the fault, plus load
PERSIST_S = 1.0  # the tracker's periodic save, so that a kill -9 finds the job saved
SLOW_RANK = 2


@dataclass
class Rig:
    """One data directory (and database) the stacks of this module start on, one at a time."""

    settings: Settings
    port: int
    stack: Stack | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> Stack:
        if self.stack is None:
            self.stack = Stack(self.settings, port=self.port, service_settings=(
                for_cpu_fake(), TrackerSettings(tracker_persist_every_s=PERSIST_S),
                ApiSettings(api_anonymous_role="viewer")))
            self.stack.start()
            wait_api(self.base, timeout_s=120)
        return self.stack

    def sigterm(self) -> None:
        """What ``greyhound up`` does on SIGTERM: every service is asked to stop, then the bus."""
        assert self.stack is not None
        self.stack.stop()
        self.stack = None

    def kill9(self) -> None:
        """SIGKILL to every service, to the nats-server and to the stack's watcher
        (stack.lifeline), back to back."""
        assert self.stack is not None
        nats = json.loads((Path(self.settings.data_dir) / "nats" / "server.json").read_text())
        groups = [p.pid for p in self.stack.procs.values()]
        if self.stack.lifeline.pid is not None:
            groups.append(self.stack.lifeline.pid)  # in a session of its own too
        for pid in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(nats["pid"]), signal.SIGKILL)
        for p in self.stack.procs.values():
            p.wait(timeout=30)
        assert self.stack.backends is not None and self.stack.backends.embedded_nats is not None
        proc = self.stack.backends.embedded_nats._proc  # the server is this process's child
        if proc is not None:
            proc.wait(timeout=30)
        self.stack = None  # nothing of it is stopped cleanly: it is gone


@pytest.fixture(scope="module")
def rig(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    root = tmp_path_factory.mktemp("restart")
    with new_database(pg_url, "rs") as db:
        # no NATS URL: the embedded one in the data directory, with its users
        r = Rig(Settings(database_url=db, token_key=TEST_TOKEN_KEY, data_dir=root / "data",
                         shm_dir=root / "shm"), free_port())
        try:
            yield r
        finally:
            if r.stack is not None:
                r.stack.stop()


def _tracked(rig: Rig, job: str, timeout_s: float) -> float:
    """Seconds until the API knows the job (the tracker recorded its hello)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        assert rig.stack is not None and not rig.stack.dead(), "services died"
        if httpx.get(f"{rig.base}/v1/jobs/{job}", timeout=5).status_code == 200:
            return time.monotonic() - t0
        time.sleep(0.2)
    raise AssertionError(f"job {job} not tracked within {timeout_s:.0f}s")


def _localized_since(row: dict[str, Any], since: datetime) -> bool:
    """Localised after ``since``: the fault's finding is its localisation. The incident itself
    may have opened a moment before: the restarted tracker reads the telemetry the job wrote
    while the stack was down, and a loaded machine's restart jitter in it can open one just
    before the fault is set, which the profile then finds slow on the faulty rank."""
    return any(e["stage"] == "localized" and datetime.fromisoformat(e["at"]) > since
               for e in row.get("timeline", []))


def _found(rig: Rig, job: str, since: datetime, timeout_s: float) -> tuple[dict[str, Any], float]:
    """The job's first incident localised to the slow rank alone after ``since`` (the fault),
    and the seconds waited. One localised before (a loaded machine's jitter can open and
    resolve a brief one on any job), or a detection naming the ranks it saw slow, does not
    count."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        assert rig.stack is not None and not rig.stack.dead(), "services died"
        r = httpx.get(f"{rig.base}/v1/incidents", params={"job_id": job}, timeout=5)
        r.raise_for_status()
        for row in r.json():
            if _localized_since(row, since) \
                    and row["kind"] in ("compute_slow", "mixed_slow") \
                    and row["culprit"].get("ranks") == [SLOW_RANK]:
                return row, time.monotonic() - t0
        time.sleep(0.2)
    raise AssertionError(f"no incident of job {job} naming rank {SLOW_RANK} opened within "
                         f"{timeout_s:.0f}s of the fault")


def _restart_while_a_job_runs(rig: Rig, stop: Callable[[Rig], None], tmp_path: Path) -> None:
    stack = rig.up()
    old, new = f"old-{uuid.uuid4().hex[:6]}", f"new-{uuid.uuid4().hex[:6]}"
    with fake_job(stack, tmp_path / "old", old, iters=6000) as running:
        running.wait_iteration(2, 100, timeout=120)
        _tracked(rig, old, TRACKED_WITHIN_S)
        time.sleep(3 * PERSIST_S)  # its state saved at least once
        stop(rig)
        stack = rig.up()  # the same data directory
        fault_at = datetime.now(UTC)
        running.faults.set(f"slow_rank {SLOW_RANK} 1.5")
        with fake_job(stack, tmp_path / "new", new, iters=6000) as fresh:
            fresh.wait_iteration(0, 1, timeout=120)
            tracked_s = _tracked(rig, new, TRACKED_WITHIN_S)
            incident, waited = _found(rig, old, fault_at, FOUND_WITHIN_S)
    print(f"restart: new job tracked {tracked_s:.1f}s after its first iteration; the old job's "
          f"slow rank found {waited:.1f}s after the new job was ({incident['summary']})")
    log = stack.log_path("tracker").read_text(errors="replace")
    assert f"job {old}: resumed detector state" in log  # from the state the old stack saved


def test_sigterm_of_the_stack_while_a_job_runs(rig: Rig, tmp_path: Path) -> None:
    _restart_while_a_job_runs(rig, Rig.sigterm, tmp_path)


def test_kill9_of_every_process_while_a_job_runs(rig: Rig, tmp_path: Path) -> None:
    _restart_while_a_job_runs(rig, Rig.kill9, tmp_path)


def test_two_sim_runs_back_to_back_in_one_data_directory(pg_url: str, tmp_path: Path) -> None:
    """The first run ends with telemetry its tracker had not consumed: it is played here through
    the stack as ``greyhound sim run`` plays it, with its tracker stopped (the job's state saved)
    a while before the end, so the rest of the job's telemetry stays in the stream as a tracker
    that fell behind leaves it. The second run is ``greyhound sim run`` itself
    (stack.sim_live.run_live): its services meet that leftover first, and must still find their
    own job's slow GPU."""
    shape = job_shape(tp=2, dp=2, pp=2, gpus_per_node=4, microbatches=4,
                      microbatch_compute_s=0.05, dp_allreduce_bytes=1e8, pp_activation_bytes=1e6,
                      optimizer_s=0.01, link_latency_us=5.0, nvlink_latency_us=1.0)
    noise = {"jitter_cv": 0.01, "gc_prob": 0.0}
    with new_database(pg_url, "sim") as db:
        settings = Settings(database_url=db, token_key=TEST_TOKEN_KEY, data_dir=tmp_path / "data",
                            shm_dir=tmp_path / "shm")
        first = scenario(shape, [], duration_s=40.0, name="first", noise=noise)
        _first_run_leaving_telemetry(first, settings)
        pending = _pending_telemetry(settings)
        second = scenario(shape, [{"kind": "gpu_slow", "rank": 3, "start_s": 30.0,
                                   "factor": 2.5}], duration_s=60.0, name="second", noise=noise)
        out, err = io.StringIO(), io.StringIO()
        assert run_live(second, settings, port=free_port(), speed=None, as_json=True, out=out,
                        err=err, settle_s=4.0) == 0, err.getvalue()
    print(f"sim twice: {pending} telemetry message(s) left for the second run's tracker")
    assert pending > 0
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    slow = [x for x in lines if x["kind"] in ("slowdown", "compute_slow", "mixed_slow")]
    assert slow, (out.getvalue(), err.getvalue()[-3000:])
    assert 30.0 < slow[0]["detected_s"] <= 60.0, slow


def _first_run_leaving_telemetry(sc: Any, settings: Settings) -> None:
    port = free_port()
    job = f"first-{uuid.uuid4().hex[:6]}"
    # only what the leftover needs: the tracker's durable fed by the agent; the API to see it
    with Stack(settings, port=port, services=("tracker", "api", "agent"), service_settings=(
            ApiSettings(api_anonymous_role="viewer"),)) as stack:
        wait_api(f"http://127.0.0.1:{port}", timeout_s=120)
        sim = LiveSimulation(sc, Path(settings.shm_dir), job)
        try:
            sim.run(should_stop=lambda: sim.virtual_s >= sc.duration_s / 2)
            deadline = time.monotonic() + 60
            while httpx.get(f"http://127.0.0.1:{port}/v1/jobs/{job}",
                            timeout=5).status_code != 200:
                assert time.monotonic() < deadline, "the first run's job was never tracked"
                time.sleep(0.2)
            tracker = stack.procs["tracker"]
            tracker.send_signal(signal.SIGTERM)  # it saves the job's state on its way out
            assert tracker.wait(timeout=60) == 0
            sim.run()  # the second half: the agent publishes it, no tracker takes it
            deadline = time.monotonic() + 60
            while any(r.lag() for r in sim.rings) and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(1.0)  # the agent's last batches published
        finally:
            sim.close(remove=True)


def _pending_telemetry(settings: Settings) -> int:
    """What the tracker's durable has not had acknowledged, read by the operator from the data
    directory's NATS (started for the look, stopped after)."""
    import asyncio

    from services.common.bus.streams import TELEMETRY, TRACKER
    from services.common.embedded import EmbeddedNats
    from tests.conftest import Bus

    server = EmbeddedNats(Path(settings.data_dir))
    server.start()

    async def look() -> int:
        nc = await Bus(server).connect()
        try:
            info = await nc.jetstream().consumer_info(TELEMETRY, TRACKER.durable)
            return int(info.num_pending or 0) + int(info.num_ack_pending or 0)
        finally:
            await nc.close()

    try:
        return asyncio.run(look())
    finally:
        server.stop()
