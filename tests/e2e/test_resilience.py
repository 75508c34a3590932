"""Never lose an incident: the live simulator (8 GPUs, TP2 DP2 PP2; GPU 3 slows 2.5x from 20 s
to 90 s of virtual time) through agent, tracker, analyzer, validator and API processes, first
undisturbed, then

* with kill -9 of each service at the moment it matters, each restarted as its supervisor
  would: the agent while the job is healthy, the tracker just after the fault began (before the
  slowdown was confirmed), the analyzer once the incident is open (mid-localisation), the
  validator once it asked the job to pause (mid-validation, the job parked);
* with the nats-server restarted as the fault begins and Postgres away for 30 s once the
  incident is open (the API answers 503 meanwhile, never 500).

Each run must end with the same incidents as the undisturbed one: one, compute_slow on rank 3,
validated on its GPU, resolved at the end of the fault, each stage once. The bus is the embedded
NATS with its users, as ``greyhound up`` runs it, restarted on its port and store.

What the fault's end leaves for the outage run to do is the test's to keep, not the machine's:
a localisation the outage cut short starts again on the analyzer's next resume pass (every
RESUME_S here; 30 s by default), and it and the validation must land while GPU 3 is still slow.
So the run stays at real time after the outage until the incident is validated. Played at 3x
after the outage with the default pass, as it was, a quiet machine that keeps the pace ran out of
fault (35 virtual seconds, 12 s of wall time) before the pass came: the validation then ran on a
healthy GPU and finished after the recovery had resolved the incident (timeline detected,
localized, resolved, validated; no GPU named), while a loaded machine, falling behind the pace,
passed.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from greyhound.sim.live import LiveProgress, LiveSimulation
from services.analyzer.settings import AnalyzerSettings
from services.api.settings import ApiSettings
from services.common.embedded import EmbeddedNats
from services.common.settings import Settings
from services.tracker.settings import TrackerSettings
from services.validator.settings import ValidatorSettings
from stack.up import Stack, wait_api
from tests.conftest import TEST_TOKEN_KEY, new_database
from tests.e2e.faults import ThreadedPgProxy, kill9, restart
from tests.e2e.story import job_story
from tests.sim.helpers import job as job_shape
from tests.sim.helpers import scenario

SLOW_GPU = 3
STAGES = ["detected", "localized", "validated", "resolved"]
RESUME_S = 2.0  # the analyzer's resume pass: an interrupted localisation starts again this soon


@dataclass
class Rig:
    stack: Stack
    nats: EmbeddedNats
    pg: ThreadedPgProxy

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.stack.port}"

    def incidents(self, job: str) -> list[dict[str, Any]] | None:
        """The job's incidents, or None while the API cannot read them (the database away)."""
        try:
            r = httpx.get(f"{self.api}/v1/incidents", params={"job_id": job}, timeout=5)
        except httpx.HTTPError:
            return None
        if r.status_code == 503:
            return None
        assert r.status_code == 200, (r.status_code, r.text[:300])
        rows: list[dict[str, Any]] = r.json()
        return rows


@pytest.fixture(scope="module")
def rig(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    """Its own embedded NATS (with its users; restartable on its port) and database (behind
    a proxy)."""
    root = tmp_path_factory.mktemp("resilience")
    with new_database(pg_url, "r") as db_url:
        yield from _rig(root, db_url)


def _rig(root: Path, db_url: str) -> Iterator[Rig]:
    nats = EmbeddedNats(root / "data")
    nats.start()
    pg = ThreadedPgProxy(db_url)
    pg.start()
    # no NATS URL: the stack uses the embedded one of its data directory and its users
    settings = Settings(database_url=pg.url, token_key=TEST_TOKEN_KEY, data_dir=root / "data",
                        shm_dir=root / "shm", outbox_poll_s=0.5, outbox_grace_s=1.0)
    port = _free_port()
    stack = Stack(settings, port=port,
                  services=("tracker", "analyzer", "validator", "api", "agent"),
                  service_settings=(
                      TrackerSettings(hang_floor_s=600.0),
                      AnalyzerSettings(resume_every_s=RESUME_S),
                      ValidatorSettings(claim_lease_s=3.0, resume_every_s=0.5,
                                        unclaimed_after_s=20.0),
                      ApiSettings(api_anonymous_role="viewer")))
    try:
        stack.start()
        wait_api(f"http://127.0.0.1:{port}")
        yield Rig(stack, nats, pg)
    finally:
        stack.stop()
        pg.close()
        nats.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Step:
    """Something the director does once, the first time its condition holds."""

    name: str
    when: Callable[[LiveProgress, list[dict[str, Any]] | None], bool]
    act: Callable[[], None]
    at_s: float | None = None  # virtual time it happened


@dataclass
class Director:
    """Drives a run: polls the job's incidents, sets the simulation's pace, injects faults."""

    rig: Rig
    sim: LiveSimulation
    job: str
    steps: list[Step] = field(default_factory=list)
    seen: list[dict[str, Any]] | None = None
    _poll_at: float = 0.0

    def __call__(self, p: LiveProgress) -> None:
        dead = self.rig.stack.dead()
        assert not dead, f"services died: {dead}"
        now = time.monotonic()
        if now >= self._poll_at:
            self._poll_at = now + 0.2
            self.seen = self.rig.incidents(self.job)
        for step in self.steps:
            if step.at_s is None and step.when(p, self.seen):
                step.act()
                step.at_s = p.virtual_s
                self.seen = self.rig.incidents(self.job)

    def pace(self, speed: float | None) -> Callable[[], None]:
        def act() -> None:
            self.sim.speed = speed
        return act


def _status(rows: list[dict[str, Any]] | None, *statuses: str) -> bool:
    return bool(rows) and any(r["status"] in statuses for r in rows or [])


def _parked(sim: LiveSimulation) -> bool:
    return any(ring.control.pause_requested() for ring in sim.rings)


def play(rig: Rig, job: str, faults: Callable[[Director], list[Step]]) -> list[dict[str, Any]]:
    """The scenario at a pace slow enough around localisation and validation for the faults to
    land mid-step, fast elsewhere; the job's incidents once everything settled."""
    j = job_shape(tp=2, dp=2, pp=2, gpus_per_node=4, microbatches=4, microbatch_compute_s=0.05,
                  dp_allreduce_bytes=1e8, pp_activation_bytes=1e6, optimizer_s=0.01,
                  link_latency_us=5.0, nvlink_latency_us=1.0)
    sc = scenario(j, [{"kind": "gpu_slow", "rank": SLOW_GPU, "start_s": 20.0, "factor": 2.5,
                       "duration_s": 70.0}],
                  duration_s=120.0, name="resilience", noise={"jitter_cv": 0.01, "gc_prob": 0.0})
    sim = LiveSimulation(sc, rig.stack.settings.shm_dir, job)
    d = Director(rig, sim, job)
    d.steps = [Step("slow down", lambda p, _: p.virtual_s >= 19.0, d.pace(3.0)),
               *faults(d),
               Step("speed up", lambda p, rows: _status(rows, "validated", "resolved"),
                    d.pace(None))]
    try:
        sim.run(on_progress=d)
        deadline = time.monotonic() + 120  # generous: a busy 2-core machine
        while time.monotonic() < deadline:  # the recovery reaches the analyzer
            rows = rig.incidents(job)
            if rows and all(r["status"] == "resolved" for r in rows):
                break
            time.sleep(0.5)
        time.sleep(3.0)  # anything late (a duplicate, a second incident) would show by now
    finally:
        sim.close(remove=True)
    for step in d.steps:
        assert step.at_s is not None, f"step {step.name!r} never happened"
    rows = rig.incidents(job)
    assert rows is not None
    return rows


def summary(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Each incident's kind, status, culprit and stages. The slowdown is suspected first and
    confirmed a few iterations later (two stages): the confirmation is a note whose place among
    the stages depends on how the localisation's window and the confirmation race (and a
    tracker killed in between delays it), so it is checked apart (`confirmed_before_validated`)
    and left out here."""
    return sorted((r["kind"], r["status"], tuple(r["culprit"].get("ranks", [])),
                   tuple(g["rank"] for g in r["culprit"].get("gpus", [])),
                   tuple(e["stage"] for e in r["timeline"]
                         if e["detail"].get("stage") != "confirmed")) for r in rows)


def confirmed_before_validated(rows: list[dict[str, Any]]) -> bool:
    """Every incident was confirmed (once) before anything paused its job to validate it."""
    for r in rows:
        stages = [("confirmed" if e["detail"].get("stage") == "confirmed" else e["stage"])
                  for e in r["timeline"]]
        if r["confirmed_at"] is None or stages.count("confirmed") != 1:
            return False
        if "validated" in stages and stages.index("confirmed") > stages.index("validated"):
            return False
    return True


EXPECTED = [("compute_slow", "resolved", (SLOW_GPU,), (SLOW_GPU,), tuple(STAGES))]


@pytest.fixture(scope="module")
def undisturbed(rig: Rig) -> list[tuple[Any, ...]]:
    rows = play(rig, f"calm-{uuid.uuid4().hex[:6]}", lambda d: [])
    assert confirmed_before_validated(rows), rows
    return summary(rows)


def test_undisturbed_run(undisturbed: list[tuple[Any, ...]]) -> None:
    assert undisturbed == EXPECTED, undisturbed


def test_kill9_of_each_service_mid_run_loses_and_repeats_nothing(
        rig: Rig, undisturbed: list[tuple[Any, ...]]) -> None:
    stack = rig.stack

    def crash(name: str) -> Callable[[], None]:
        def act() -> None:
            kill9(stack, name)
            restart(stack, name)
        return act

    def faults(d: Director) -> list[Step]:
        return [
            Step("kill agent", lambda p, _: p.virtual_s >= 8.0, crash("agent")),
            Step("kill tracker", lambda p, _: p.virtual_s >= 22.0, crash("tracker")),
            Step("kill analyzer", lambda p, rows: _status(rows, "detected"), crash("analyzer")),
            Step("kill validator", lambda p, rows: _parked(d.sim), crash("validator")),
        ]

    job = f"kill-{uuid.uuid4().hex[:6]}"
    rows = play(rig, job, faults)
    assert summary(rows) == undisturbed and confirmed_before_validated(rows), _told(rig, job, rows)
    # each kill hit a step in flight, and the restarted service took it up
    logs = {name: _log(rig, name) for name in ("tracker", "analyzer", "validator")}
    assert f"job {job}: resumed detector state" in logs["tracker"]
    assert f"of job {job}: its localisation never finished; starting it again" in logs["analyzer"]
    assert f"of job {job}: validating it again" in logs["validator"]


def _told(rig: Rig, job: str, rows: list[dict[str, Any]]) -> str:
    """The incidents and the services' last words on the job, for a failure's message."""
    return f"{rows}\n{job_story(rig.stack.settings.data_dir, job, last=25)}"


def _log(rig: Rig, name: str) -> str:
    return (Path(rig.stack.settings.data_dir) / "logs" / f"{name}.log").read_text(errors="replace")


def test_nats_restart_and_postgres_away_30s_lose_and_repeat_nothing(
        rig: Rig, undisturbed: list[tuple[Any, ...]]) -> None:
    answers: list[tuple[str, int, str]] = []
    outage: list[threading.Thread] = []

    def restart_nats() -> None:
        port = rig.nats.port
        rig.nats.stop()
        time.sleep(1.0)
        rig.nats.start(port=port)

    def without_postgres(sim: LiveSimulation) -> None:
        """30 s without the database while the run goes on at real time; the API is asked
        what it can serve meanwhile."""
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < 30.0:
                for path in ("/v1/incidents", "/readyz", "/healthz"):
                    r = httpx.get(f"{rig.api}{path}", timeout=5)
                    answers.append((path, r.status_code, r.headers.get("content-type", "")))
                time.sleep(2.0)
        finally:
            rig.pg.start()  # real time still, until validated (see the module docstring)

    def faults(d: Director) -> list[Step]:
        def postgres_away() -> None:
            d.sim.speed = 1.0
            rig.pg.stop()
            outage.append(threading.Thread(target=without_postgres, args=(d.sim,), daemon=True))
            outage[0].start()

        return [
            Step("restart nats", lambda p, _: p.virtual_s >= 21.0, restart_nats),
            Step("postgres away 30 s", lambda p, rows: _status(rows, "detected"), postgres_away),
        ]

    job = f"outage-{uuid.uuid4().hex[:6]}"
    rows = play(rig, job, faults)
    outage[0].join(timeout=60)
    assert summary(rows) == undisturbed and confirmed_before_validated(rows), _told(rig, job, rows)
    codes = {(path, code) for path, code, _ in answers}
    assert codes == {("/v1/incidents", 503), ("/readyz", 503), ("/healthz", 200)}, answers
    assert all(ct.startswith("application/problem+json") for p, c, ct in answers
               if p == "/v1/incidents"), answers
