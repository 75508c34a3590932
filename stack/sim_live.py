"""``greyhound sim run SCENARIO.yaml`` live: the simulated job through the whole real stack.

The live branch of greyhound.sim.cli, which the library leaves to the composition root.

The services (agent, tracker, analyzer, API; embedded NATS and Postgres when no URLs are set)
run as in production and know nothing of the fault list; the simulator only writes rings. At
the end the incidents come from the REST API, their times mapped back to virtual seconds. A
scenario with a ``mitigation`` section also follows the planner's plans (stack.sim_plans) with
a job token made for the run. The services stop with the run unless ``--serve`` keeps them
serving (the API and the dashboard) until Ctrl-C; the data stays in the data directory either
way. A second run on the same port or ring directory is refused (stack.claims).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import httpx

from greyhound.ids import slug
from greyhound.integrations.rest import PlanClient
from greyhound.sim.live import LiveProgress, LiveSimulation
from greyhound.sim.pace import PacePolicy, Pacer
from greyhound.sim.scenario import Scenario
from greyhound.sim.score import sim_node, wall_ns
from services.api.settings import ApiSettings
from services.common.settings import Settings, get_settings
from stack.claims import Collision, claim
from stack.lag import TrackerLag
from stack.serve import serve_until_stopped, stop_signals
from stack.sim_plans import SimPlanFollower, mint_token
from stack.up import Stack, wait_api


def job_id_for(scenario: Scenario) -> str:
    return f"sim-{slug(scenario.name, 40) or 'scenario'}-{uuid.uuid4().hex[:6]}"


def incident_line(incident: dict[str, Any], virtual_at: Callable[[int], float]) -> dict[str, Any]:
    """One incident as the CLI reports it; what the incident does not say yet is empty/null."""
    culprit = incident.get("culprit") or {}

    def when(stage: str) -> float | None:
        for entry in incident.get("timeline") or []:
            if entry.get("stage") == stage:
                return round(virtual_at(wall_ns(entry["at"])), 3)
        return None

    return {
        "kind": incident["kind"],
        "ranks": list(culprit.get("ranks") or []),
        "nodes": [sim_node(n) for n in culprit.get("nodes") or []],
        "links": [[sim_node(n) for n in x] for x in culprit.get("links") or []],
        "detected_s": round(virtual_at(wall_ns(incident["opened_at"])), 3),
        "localized_s": when("localized"),
    }


class _Reporter:
    """Progress on stderr, at most once a second."""

    def __init__(self, err: TextIO) -> None:
        self.err = err
        self.next = 0.0

    def __call__(self, p: LiveProgress, *, force: bool = False) -> None:
        now = time.monotonic()
        if now < self.next and not force:
            return
        self.next = now + 1.0
        print(f"virtual {p.virtual_s:9.1f} s  iterations {p.iterations:7d}  speed "
              f"{p.speed:6.1f}x{'  (hung)' if p.hung else ''}", file=self.err, flush=True)


DEFAULT_PACE = PacePolicy(fast=4.0)  # without --speed: greyhound.sim.pace, at most 4x
FOLLOW_TIMEOUT_S = 60.0  # after the run, how long the tracker may take to read what is left

# What runs after the report while the stack still serves (``--serve``): given the stack and the
# API's address, it returns the command's exit code.
AfterRun = Callable[[Stack, str], int]


def run_live(scenario: Scenario, settings: Settings, *, port: int, speed: float | None,
             as_json: bool, out: TextIO, err: TextIO, settle_s: float = 5.0,
             after: AfterRun | None = None) -> int:
    """Without ``speed``, the run is paced (DEFAULT_PACE): real time around each fault's onset
    and while the services profile or pause the job, up to 4x otherwise, slower while the
    tracker lags. Either way, a run whose telemetry the tracker had not read by the end
    (FOLLOW_TIMEOUT_S after it) says so and exits 3: its incidents would under-count."""
    try:
        with claim(shm_dir=settings.shm_dir, data_dir=settings.data_dir, host="127.0.0.1",
                   port=port):
            return _run_live(scenario, settings, port=port, speed=speed, as_json=as_json,
                             out=out, err=err, settle_s=settle_s, after=after)
    except Collision as exc:
        print(f"greyhound sim run: {exc}", file=err)
        return 2


def _run_live(scenario: Scenario, settings: Settings, *, port: int, speed: float | None,
              as_json: bool, out: TextIO, err: TextIO, settle_s: float,
              after: AfterRun | None) -> int:
    base = f"http://127.0.0.1:{port}"
    job = job_id_for(scenario)
    print(f"starting the services (data in {settings.data_dir}) ...", file=err, flush=True)
    # The incidents are read back over REST on loopback without a token.
    with Stack(settings, port=port,
               service_settings=(ApiSettings(api_anonymous_role="viewer"),)) as stack, \
            TrackerLag(stack) as lag:
        wait_api(base)
        pacer = None if speed is not None else Pacer(DEFAULT_PACE,
                                                     [f.start_s for f in scenario.faults])
        sim = LiveSimulation(scenario, Path(settings.shm_dir), job,
                             speed=speed if speed is not None else DEFAULT_PACE.slow)
        report = _Reporter(err)
        dead: list[str] = []
        most_behind = [0]
        follower = _follower(scenario, sim, stack, base, job)
        t0 = time.monotonic()

        def should_stop() -> bool:
            if follower is not None:
                follower.poll()
            if time.monotonic() >= report.next:
                dead.extend(stack.dead())
            most_behind[0] = max(most_behind[0], lag.pending or 0)
            if pacer is not None:
                sim.speed = pacer.speed(sim.virtual_s, time.monotonic() - t0,
                                        busy=sim.attended, lag=lag.pending)
            return bool(dead)

        try:
            print(f"job {job}: {scenario.job.world} simulated GPUs, {scenario.duration_s:g} "
                  "virtual seconds", file=err, flush=True)
            final = sim.run(on_progress=report, should_stop=should_stop)
            report(final, force=True)
            if dead:
                print(f"service(s) {', '.join(dead)} exited; see {settings.data_dir}/logs",
                      file=err)
                return 1
            _drain(sim, stack, settle_s, lag)
            backlog = lag.pending
            r = httpx.get(f"{base}/v1/incidents", params={"job_id": job, "limit": 1000},
                          timeout=10.0)
            r.raise_for_status()
            found = sorted(((incident_line(i, sim.virtual_at), i) for i in r.json()),
                           key=lambda x: x[0]["detected_s"])
        finally:
            sim.close(remove=True)
        if pacer is not None:
            print(f"paced: {pacer.report().describe()}", file=err)
        _print_report(job, found, follower, as_json=as_json, out=out, err=err)
        behind = _said_behind(backlog, most_behind[0], err)
        if after is not None:
            code = after(stack, base)
            return 3 if behind else code
    print(f"the services stopped with the run; its data stays in {settings.data_dir}: "
          f"`greyhound up --port {port}` with the same settings serves it again (GET "
          f"/v1/incidents?job_id={job} with a token from `greyhound token create --role "
          "viewer`), or run with --serve to keep serving when the run ends", file=err)
    return 3 if behind else 0


def _said_behind(backlog: int | None, most_behind: int, err: TextIO) -> bool:
    """Whether the tracker had telemetry unread after the run (said on ``err``): then the
    incidents reported under-count, and the command exits 3."""
    if backlog is not None and backlog <= 0:
        return False
    print(f"the services could not follow this run: the tracker had "
          f"{'an unknown number of' if backlog is None else backlog} telemetry messages "
          f"unread {FOLLOW_TIMEOUT_S:g} s after it ended (at most {most_behind} during "
          f"it); the incidents above are incomplete: run it slower (--speed 1)", file=err)
    return True


def _print_report(job: str, found: list[tuple[dict[str, Any], dict[str, Any]]],
                  follower: SimPlanFollower | None, *, as_json: bool, out: TextIO,
                  err: TextIO) -> None:
    if follower is not None:
        for step in follower.steps:
            print(f"plan version {step.version}: {step.action} {step.strategy} from "
                  f"{step.virtual_s:.1f} s virtual (cost {step.cost_s:.2f} s)"
                  f"{'; failed: ' + step.error if step.error else ''}", file=err)
    if as_json:
        for line, _ in found:
            out.write(json.dumps(line) + "\n")
    else:
        out.write(text_report(job, found))


def text_report(job: str, found: list[tuple[dict[str, Any], dict[str, Any]]]) -> str:
    """The incidents for a person: kind, when, what they name (a link by its nodes, GPUs, else
    ranks), how they ended and what they cost."""
    rows = [f"{len(found)} incident(s) for job {job} (virtual seconds):\n"]
    for x, incident in found:
        cost = incident.get("cost") or {}
        lost, saved = cost.get("gpu_hours_lost"), cost.get("gpu_hours_saved")
        money = "" if lost is None else f"; {lost:.3f} GPU-h lost" + (
            "" if saved is None else f", {saved:.3f} saved by plans")
        rows.append(f"  {x['kind']:10} detected at {x['detected_s']:9.1f} s  {culprit_words(x, incident)}"
                    f"  ({incident.get('status', '?')}{money})\n")
    return "".join(rows)


def culprit_words(line: dict[str, Any], incident: dict[str, Any]) -> str:
    gpus = [g for g in (incident.get("culprit") or {}).get("gpus") or [] if isinstance(g, dict)]
    if line["links"]:
        return "link " + ", ".join("-".join(map(str, pair)) for pair in line["links"][:4])
    if gpus:
        return "GPU " + ", ".join(f"{sim_node(g.get('host'))}:{g.get('device')} (rank "
                                  f"{g.get('rank')})" for g in gpus[:4])
    if line["nodes"]:
        return f"nodes {line['nodes'][:8]}"
    ranks = line["ranks"]
    return f"ranks {ranks[:8]}{' ...' if len(ranks) > 8 else ''}"


def _follower(scenario: Scenario, sim: LiveSimulation, stack: Stack, base: str,
              job: str) -> SimPlanFollower | None:
    """The simulated job's plan follower, when the scenario asks for one (with a job token)."""
    if not scenario.follows_plans or scenario.mitigation is None:
        return None
    assert stack.backends is not None
    key = stack.settings.token_key
    token = mint_token(stack.backends.database_url, role="job", name=job, job_id=job,
                       token_key=None if key is None else key.get_secret_value().encode())
    follower = SimPlanFollower(sim, PlanClient(base, job, token, timeout_s=5.0),
                               poll_s=scenario.mitigation.poll_s)
    follower.start()
    return follower


def _drain(sim: LiveSimulation, stack: Stack, settle_s: float, lag: TrackerLag) -> None:
    """Let the agent consume every ring and the tracker read all it published (at most
    FOLLOW_TIMEOUT_S), then give the analyzer ``settle_s``."""
    deadline = time.monotonic() + FOLLOW_TIMEOUT_S
    while (any(r.lag() for r in sim.rings) or lag.pending != 0) \
            and time.monotonic() < deadline and not stack.dead():
        time.sleep(0.1)
    time.sleep(settle_s)


def run_from_args(scenario: Scenario, args: argparse.Namespace) -> int:
    """greyhound.sim.cli's live runner: its arguments, the process's settings (with the data
    directory's keys: it mints the job's token)."""
    from services.common.data_keys import with_data_dir_keys

    settings = with_data_dir_keys(get_settings())

    def serve(stack: Stack, base: str) -> int:
        print(f"serving the REST API and the dashboard ({base}/dashboard/; reads need no "
              "token on loopback, approving needs one: greyhound token create --role "
              "operator); Ctrl-C stops it", file=sys.stderr, flush=True)
        with stop_signals() as stopped:
            return serve_until_stopped(stack, settings.data_dir, stopped)

    return run_live(scenario, settings, port=args.port or ApiSettings().api_port, speed=args.speed,
                    as_json=args.json, out=sys.stdout, err=sys.stderr, settle_s=args.settle,
                    after=serve if args.serve else None)
