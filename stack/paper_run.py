"""The paper demo's "with Greyhound" run: the scenario live through every real layer.

The simulated ranks write hook rings; the node agent, NATS JetStream, the tracker, analyzer,
validator, planner, Postgres and the REST API do the rest, knowing nothing of the fault list.
The simulated job follows its plans as a training job does (stack.sim_plans: a job token, the
plan polled over REST, applied at an iteration boundary with the scenario's modelled cost,
reported). An operator, scripted here, approves what the policy leaves to a person (S3 by
default) over REST with an operator token, and reads the incidents with it.

The pace (greyhound.sim.pace) is real time around each fault's onset until the services have
named it, and whenever they profile or pause the job; faster otherwise, held back when the
tracker lags. The driver knows the schedule only to pace and to score.
"""

from __future__ import annotations

import logging
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx
import numpy as np

from greyhound.ids import slug
from greyhound.integrations.rest import PlanClient
from greyhound.sim.live import LiveProgress, LiveSimulation
from greyhound.sim.pace import PacePolicy, Pacer, PaceReport
from greyhound.sim.scenario import MitigationSpec, Scenario
from greyhound.sim.score import Found, score_faults
from stack.lag import TrackerLag
from stack.sim_plans import SimPlanFollower, Step, mint_token
from stack.up import Stack

log = logging.getLogger(__name__)
POLL_S = 2.0  # wall seconds between two reads of the incidents and plans
SETTLE_AFTER_NAMED_S = 20.0  # virtual seconds of real time kept after a fault is named, for
# its validation, when no validation comes first


@dataclass
class WithResult:
    job: str
    iterations: list[tuple[float, float]]
    steps: list[Step]
    incidents: list[dict[str, Any]]
    plans: list[dict[str, Any]]
    found: list[Found]
    pace: PaceReport
    approved: list[str]
    virtual_s: float
    wall_s: float
    followed: bool  # the services read all the telemetry before the end (no backlog left)
    backlog: int | None
    virtual_at: Callable[[int], float] = field(repr=False, default=lambda _: 0.0)


class Operator:
    """On-call, scripted: reads over REST with an operator token and approves each proposal
    that waits for a person, with a note, as someone on the dashboard would."""

    def __init__(self, base: str, job: str, token: str) -> None:
        self.base, self.job = base, job
        self.http = httpx.Client(timeout=10.0, headers={"Authorization": f"Bearer {token}"})
        self.approved: list[str] = []

    def get(self, path: str, **params: Any) -> Any:
        r = self.http.get(f"{self.base}{path}", params=params)
        r.raise_for_status()
        return r.json()

    def incidents(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = self.get("/v1/incidents", job_id=self.job, limit=1000)
        return rows

    def plans(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = self.get("/v1/plans", job_id=self.job)
        return rows

    def approve_waiting(self, plans: list[dict[str, Any]]) -> list[str]:
        done = []
        for p in plans:
            if p["status"] != "proposed" or p["id"] in self.approved:
                continue
            note = f"on-call approves {p['strategy']}: {p['params'].get('summary', '')}"[:500]
            r = self.http.post(f"{self.base}/v1/plans/{p['id']}/approve", json={"note": note})
            if r.status_code == 200:
                self.approved.append(p["id"])
                done.append(p["id"])
            else:  # decided meanwhile (expired, withdrawn): nothing to do
                log.info("plan %s not approved: %s %s", p["id"], r.status_code, r.text[:200])
        return done

    def close(self) -> None:
        self.http.close()


def play_with(stack: Stack, sc: Scenario, policy: PacePolicy, *,
              on_progress: Callable[[LiveProgress, str, list[Found], list[Step]], None]
              | None = None, err: TextIO | None = None) -> WithResult:
    """Play ``sc`` live on a running stack, following plans; return what happened."""
    err = err or sys.stderr
    assert stack.backends is not None
    base = f"http://127.0.0.1:{stack.port}"
    job = f"paper-{slug(sc.name, 30) or 'scenario'}-{uuid.uuid4().hex[:6]}"
    db = stack.backends.database_url
    key = stack.settings.token_key
    token_key = None if key is None else key.get_secret_value().encode()
    operator = Operator(base, job, mint_token(db, role="operator", name="demo-oncall",
                                              token_key=token_key))
    sim = LiveSimulation(sc, Path(stack.settings.shm_dir), job, speed=policy.slow)
    poll_s = (sc.mitigation or MitigationSpec()).poll_s
    follower = SimPlanFollower(sim, PlanClient(base, job, mint_token(
        db, role="job", name=f"job-{job}", job_id=job, token_key=token_key), timeout_s=5.0),
        poll_s=poll_s)
    pacer = Pacer(policy, [f.start_s for f in sc.faults], ends=[
        f.start_s + f.duration_s if f.duration_s is not None else float("inf")
        for f in sc.faults])
    incidents: list[dict[str, Any]] = []
    plans: list[dict[str, Any]] = []
    found: list[Found] = []
    layouts = Layouts(sim)
    next_poll = [0.0]
    t0 = time.monotonic()
    dead: list[str] = []
    try:
        follower.start()
        with TrackerLag(stack) as lag:
            def should_stop() -> bool:
                nonlocal incidents, plans, found
                follower.poll()
                layouts.note(follower.steps)
                now = time.monotonic()
                if now >= next_poll[0]:
                    next_poll[0] = now + POLL_S
                    dead.extend(stack.dead())
                    try:
                        incidents, plans = operator.incidents(), operator.plans()
                        operator.approve_waiting(plans)
                    except httpx.HTTPError as exc:
                        log.warning("the API did not answer: %s", exc)
                    found = score_faults(sc, incidents, _clock(sim), rank_of_gpu=layouts.at)
                    for f in found:
                        if reacted(sc, f, plans, sim.virtual_s):
                            pacer.settle(f.fault)
                    for i in pacer.ending(sim.virtual_s):
                        if not held_at_end(sc, i, found, plans, sim.virtual_s):
                            pacer.settle_end(i)
                # a plan on its way to the job (proposed, approved, not applied yet) is the
                # services' wall-clock work on it too: its delivery runs at real time
                on_way = any(p["status"] in ("proposed", "approved") for p in plans)
                sim.speed = pacer.speed(sim.virtual_s, now - t0, busy=sim.attended or on_way,
                                        lag=lag.pending)
                return bool(dead)

            def progress(p: LiveProgress) -> None:
                if on_progress is not None:
                    on_progress(p, pacer.mode, found, follower.steps)

            sim.run(on_progress=progress, should_stop=should_stop)
            if dead:
                raise RuntimeError(f"service(s) {', '.join(dead)} exited; see "
                                   f"{stack.settings.data_dir}/logs")
            follower.poll()
            backlog = _settle(sim, stack, lag)
        incidents, plans = operator.incidents(), operator.plans()
        virtual_at = _clock(sim)
        found = score_faults(sc, incidents, virtual_at, rank_of_gpu=layouts.at)
        return WithResult(job, sim.iteration_times(), list(follower.steps), incidents, plans,
                          found, pacer.report(), list(operator.approved), sim.virtual_s,
                          time.monotonic() - t0, backlog == 0, backlog, virtual_at)
    finally:
        operator.close()
        sim.close(remove=True)


HELD_STRATEGIES = ("S2",)  # plans the planner takes back on a re-check of the culprit


def reacted(sc: Scenario, f: Found, plans: list[dict[str, Any]], virtual_s: float) -> bool:
    """Whether the services' reaction to fault ``f.fault`` is over: named, validated and a plan
    of its incident taken effect, or named ``SETTLE_AFTER_NAMED_S`` ago with no validation.
    After the validation the planner decides on the iterations it reads (ski rental: an S3
    waits until the loss reaches its cost) a few wall seconds behind the job; at 8x those
    seconds were 20 virtual ones in one run, an S3 16 s later than in the next."""
    if f.localize_s is None:
        return False
    if f.validate_s is None:
        return virtual_s > sc.faults[f.fault].start_s + f.localize_s + SETTLE_AFTER_NAMED_S
    return any(p["incident_id"] == f.incident_id and p["status"] in ("applied", "reverted")
               for p in plans)


def held_at_end(sc: Scenario, fault: int, found: list[Found], plans: list[dict[str, Any]],
                virtual_s: float) -> bool:
    """Whether fault ``fault`` (ended, or about to) still has a plan in force that the services
    take back on their own wall-clock re-checks: an S2 plan of the incident that named it, not
    needed by another fault of that incident still going on. Such a plan slows the healthy job
    (its re-balance puts more micro-batches on the others) until it is reverted."""
    mine = next((f.incident_id for f in found if f.fault == fault), None)
    if mine is None:
        return False
    for j, other in enumerate(sc.faults):
        end = other.start_s + other.duration_s if other.duration_s is not None else float("inf")
        if j != fault and other.start_s <= virtual_s < end and any(
                f.fault == j and f.incident_id == mine for f in found):
            return False  # its plan is that fault's too: taken back at that one's end
    return any(p["incident_id"] == mine and p["strategy"] in HELD_STRATEGIES
               and p["status"] in ("proposed", "approved", "applied") for p in plans)


class Layouts:
    """Which rank each GPU ran, over virtual time: a topology plan moves ranks, and a fault
    strikes a GPU, so scoring asks who ran there at the fault's onset."""

    def __init__(self, sim: LiveSimulation) -> None:
        self.sim = sim
        self.version = sim.model.layout.version
        self.history: list[tuple[float, list[int]]] = [
            (0.0, sim.model.layout.rank_of_gpu().tolist())]

    def note(self, steps: list[Step]) -> None:
        layout = self.sim.model.layout
        if layout.version != self.version:
            self.version = layout.version
            since = steps[-1].virtual_s if steps else self.sim.virtual_s
            self.history.append((since, layout.rank_of_gpu().tolist()))

    def at(self, t: float) -> list[int]:
        return next(r for since, r in reversed(self.history) if since <= t)


def _clock(sim: LiveSimulation) -> Callable[[int], float]:
    """The run's wall-to-virtual map as it stands (sim.virtual_at rebuilds it at every call)."""
    w, v = np.array(sim.samples, dtype=np.float64).T

    def virtual_at(wall_ns: int) -> float:
        return float(np.interp(float(wall_ns), w, v))

    return virtual_at


def _settle(sim: LiveSimulation, stack: Stack, lag: TrackerLag, timeout_s: float = 60.0,
            quiet_s: float = 3.0) -> int | None:
    """After the run: wait until the agent drained every ring and the tracker has no backlog,
    then ``quiet_s`` more for the analyzer; the tracker's backlog left (None: unknown)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stack.dead():
        if not any(r.lag() for r in sim.rings) and lag.pending == 0:
            break
        time.sleep(0.2)
    time.sleep(quiet_s)
    return lag.pending
