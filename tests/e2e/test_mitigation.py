"""Ski-rental escalation with the whole stack and the live simulator (16 GPUs, TP2 DP4 PP2):

* a GPU at half speed: S2 once the loss pays for half the re-balance (automatic; a compute
  fail-slow is expected to last 10 minutes), applied by the simulated job at an iteration
  boundary, the incident mitigated; re-checked while it is in force, reverted once the GPU is
  healthy again, and the incident resolved;
* a congested DP link: no S2 for a link; S3 proposed only once the loss reaches half its
  overhead (the default trust in the expected duration: a congestion is expected to last 24
  minutes, past the break-even), held for an operator's approval (given here over REST with
  an operator token), applied with its pause, and reverted when the congestion ends;
* the slow GPU again, the planner killed (SIGKILL) once S2 is in force and restarted: the same
  end, nothing lost or done twice (issue 13's kill -9 of each service, for the planner).

All run on one stack of their own (embedded NATS with its users and Postgres, small overheads
from the planner's settings) at 10x virtual time, under a minute each on an idle machine; the iteration times
before, during and after mitigation and the incidents' timelines are printed (``pytest -s``).
"""

from __future__ import annotations

import re
import socket
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from greyhound.integrations.rest import PlanClient
from greyhound.sim.live import LiveSimulation
from greyhound.sim.scenario import Scenario, load_scenario
from services.api.settings import ApiSettings
from services.api.tokens import token_key
from services.common.settings import Settings
from services.planner.settings import PlannerSettings
from stack.sim_plans import SimPlanFollower, Step, mint_token
from stack.up import Stack, wait_api
from tests.e2e.faults import kill9, restart

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"
SPEED = 10.0
PLANNER = PlannerSettings(s2_overhead_s=2.0, s3_overhead_s=40.0, s4_overhead_s=1e6,
                          recheck_s=8.0, poll_s=0.2, proposal_ttl_s=300.0, hold_max_s=0.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def mstack() -> Iterator[Stack]:
    """A stack of its own: the package's shared one runs a planner with default settings on
    the session's NATS, and two planners on one durable would split the events."""
    with tempfile.TemporaryDirectory(prefix="gh-mitigate-") as d:
        root = Path(d)
        # no URLs: embedded NATS (with its users) and Postgres in the data directory, as
        # `greyhound up` starts them
        settings = Settings(data_dir=root / "data", shm_dir=root / "shm")
        with Stack(settings, port=_free_port(), service_settings=(
                PLANNER, ApiSettings(api_anonymous_role="viewer"))) as st:
            wait_api(f"http://127.0.0.1:{st.port}")
            yield st


class Run:
    """One scenario played through the stack, its job following plans."""

    def __init__(self, stack: Stack, name: str) -> None:
        self.stack = stack
        self.scenario: Scenario = load_scenario(SCENARIOS / f"{name}.yaml")
        self.job = f"{name}-{uuid.uuid4().hex[:6]}"
        self.base = f"http://127.0.0.1:{stack.port}"
        assert stack.backends is not None
        db = stack.backends.database_url
        key = token_key(stack.settings)  # the data directory's, as the stack's API has it
        self.operator = mint_token(db, role="operator", name="oncall", token_key=key)
        self.sim = LiveSimulation(self.scenario, stack.settings.shm_dir, self.job, speed=SPEED)
        self.follower = SimPlanFollower(
            self.sim, PlanClient(self.base, self.job, mint_token(
                db, role="job", name=self.job, job_id=self.job, token_key=key), timeout_s=5.0))
        self.incidents: list[dict[str, Any]] = []
        self.plans: list[dict[str, Any]] = []
        self.approved: list[str] = []

    def get(self, path: str, **params: Any) -> Any:
        r = httpx.get(f"{self.base}{path}", params=params, timeout=10)
        r.raise_for_status()
        return r.json()

    def approve(self, plan_id: str, note: str) -> dict[str, Any]:
        r = httpx.post(f"{self.base}/v1/plans/{plan_id}/approve", json={"note": note},
                       headers={"Authorization": f"Bearer {self.operator}"}, timeout=10)
        assert r.status_code == 200, r.text
        self.approved.append(plan_id)
        body: dict[str, Any] = r.json()
        return body

    def play(self, done: Callable[[Run], bool],
             on_poll: Callable[[Run], None] | None = None) -> None:
        self.follower.start()
        next_poll = [0.0]

        def should_stop() -> bool:
            assert not self.stack.dead(), f"services died: {self.stack.dead()}"
            self.follower.poll()
            if time.monotonic() < next_poll[0]:
                return False
            next_poll[0] = time.monotonic() + 0.5
            self.incidents = self.get("/v1/incidents", job_id=self.job)
            self.plans = self.get("/v1/plans", job_id=self.job)
            if on_poll is not None:
                on_poll(self)
            return done(self)

        try:
            self.sim.run(should_stop=should_stop)
            self.follower.poll()  # the last reports
            time.sleep(1.0)
            self.incidents = self.get("/v1/incidents", job_id=self.job)
            self.plans = self.get("/v1/plans", job_id=self.job)
        finally:
            self.sim.close(remove=True)

    def named(self) -> list[dict[str, Any]]:
        return [i for i in self.incidents if i["kind"].endswith("_slow")]

    def describe(self) -> str:
        return repr([(i["kind"], i["status"], [e["stage"] for e in i["timeline"]])
                     for i in self.incidents] + [(p["strategy"], p["status"], p["policy"])
                                                 for p in self.plans])

    def print_phases(self, fault_start: float, fault_end: float) -> None:
        """Median iteration time in each phase: before the fault, slow, under the plan while
        the fault lasts, under the plan after it, after the revert."""
        its = self.sim.iteration_times()
        applied = [s for s in self.follower.steps if s.action == "apply"]
        reverted = [s for s in self.follower.steps if s.action == "revert"]
        on = applied[0].virtual_s if applied else float("inf")
        off = reverted[-1].virtual_s if reverted else float("inf")
        phases = [("before the fault", 0.0, fault_start),
                  ("slow, no plan yet", fault_start, min(on, fault_end)),
                  ("under the plan, fault on", on, fault_end),
                  ("under the plan, fault over", max(on, fault_end), off),
                  ("after the revert", off, float("inf"))]
        print(f"\n{self.job}: iteration times (virtual s; plan steps {_steps(self.follower.steps)})")
        print(f"  {'phase':28} {'from':>7} {'to':>7} {'iters':>6} {'median':>8}")
        for name, lo, hi in phases:
            xs = [d for s, d in its if lo + 0.5 <= s < hi - 0.5]
            med = f"{statistics.median(xs):8.3f}" if xs else "       -"
            print(f"  {name:28} {lo:7.1f} {min(hi, its[-1][0]):7.1f} {len(xs):6d} {med}")

    def medians(self, lo: float, hi: float) -> float:
        return statistics.median(d for s, d in self.sim.iteration_times() if lo <= s < hi)


def _steps(steps: list[Step]) -> str:
    return ", ".join(f"v{s.version} {s.action} {s.strategy} @{s.virtual_s:.0f}s" for s in steps)


def _ran_revert(run: Run) -> bool:
    """The simulated job runs the revert (and a few iterations after it)."""
    done = [s for s in run.follower.steps if s.action == "revert"]
    return bool(done) and run.sim.virtual_s > done[-1].virtual_s + 5.0


def _plan(run: Run, strategy: str) -> dict[str, Any] | None:
    return next((p for p in run.plans if p["strategy"] == strategy), None)


def test_compute_fail_slow_reaches_s2_and_is_reverted_after_it_ends(mstack: Stack) -> None:
    run = Run(mstack, "mitigate-gpu-16")

    def done(r: Run) -> bool:
        s2 = _plan(r, "S2")
        return bool(s2 and s2["status"] == "reverted" and r.named()
                    and r.named()[0]["status"] == "resolved" and _ran_revert(r))

    run.play(done)
    run.print_phases(60.0, 220.0)
    (incident,) = run.named()
    assert incident["kind"] == "compute_slow" and incident["culprit"]["ranks"] == [2], \
        run.describe()
    s2 = _plan(run, "S2")
    assert s2 is not None, run.describe()
    # automatic, approved by the policy, delivered, applied with the job's reported cost
    assert s2["policy"] == "automatic" and s2["status"] == "reverted", run.describe()
    assert [a["approver"] for a in s2["approvals"]] == ["policy"]
    assert s2["params"]["loss_s"] >= PLANNER.trust * PLANNER.s2_overhead_s and s2["cost_s"] == 0.5
    assert s2["params"]["slow_dp_groups"] == [1]
    assert s2["params"]["microbatches"][1] < 4 and sum(s2["params"]["microbatches"]) == 16
    assert not [p for p in run.plans if p["strategy"] != "S2" and p["applied_at"]]
    # every step is on the incident's timeline, in order; the end either way round: a re-check
    # finds the GPU healthy (reverted, then the tracker's recovery resolves it), or the tracker
    # sees the fault's end under the plan first (resolved, then reverted)
    stages = [e["stage"] for e in incident["timeline"]]
    print(f"  timeline: {' '.join(stages)}")
    order = ["detected", "localized", "validated", "plan_proposed", "plan_approved", "mitigated"]
    assert _in_order(stages, order), " ".join(stages)
    tail = stages[stages.index("mitigated"):]
    assert "plan_reverted" in tail and "resolved" in tail, " ".join(stages)
    # the job ran the plan and then its own split again: apply and revert, both reported
    steps = [(s.action, s.strategy) for s in run.follower.steps]
    assert steps[:1] == [("apply", "S2")] and steps[-1] == ("revert", "S2"), steps
    assert run.get(f"/v1/jobs/{run.job}/plan")["microbatches"] is None
    # S2 helped: the iterations under the plan (fault on) beat the slow ones before it
    on = next(s.virtual_s for s in run.follower.steps if s.action == "apply")
    slow, mitigated = run.medians(65.0, on - 1.0), run.medians(on + 2.0, 218.0)
    assert mitigated < 0.9 * slow, (slow, mitigated)


def test_congested_link_waits_for_the_loss_and_an_approval_then_s3_is_reverted(
        mstack: Stack) -> None:
    run = Run(mstack, "mitigate-link-16")
    seen_loss: list[float] = []

    def approve(r: Run) -> None:
        for p in r.plans:
            if p["status"] == "proposed" and p["strategy"] == "S3" and p["id"] not in r.approved:
                seen_loss.append(p["params"]["loss_s"])
                body = r.approve(p["id"], "swap the nodes, congestion on 0-1")
                assert body["status"] == "approved"

    def done(r: Run) -> bool:
        s3 = _plan(r, "S3")
        return bool(s3 and s3["status"] == "reverted" and _ran_revert(r))

    run.play(done, on_poll=approve)
    run.print_phases(60.0, 340.0)
    named = run.named()
    assert named and named[0]["kind"] in ("comm_slow", "mixed_slow"), run.describe()
    incident = named[0]
    assert not _plan(run, "S2"), run.describe()  # S2 cannot help a link
    s3 = _plan(run, "S3")
    assert s3 is not None and s3["policy"] == "approval", run.describe()
    # proposed only once the loss reached trust x S3's overhead, and held for the operator
    assert PLANNER.trust == 0.5  # the default: what a user runs
    assert seen_loss and seen_loss[0] >= PLANNER.trust * PLANNER.s3_overhead_s
    assert "expected to last 1440 s, past the break-even" in s3["params"]["why"], s3["params"]
    assert s3["params"]["kind"] == "role_swap" and s3["params"]["links"] == [[0, 1]]
    assert [(a["decision"], a["approver"]) for a in s3["approvals"]] == [("approve", "oncall")]
    assert s3["status"] == "reverted" and s3["cost_s"] == 10.0, run.describe()
    stages = [e["stage"] for e in incident["timeline"]]
    print(f"  timeline: {' '.join(stages)}")
    assert _in_order(stages, ["validated", "plan_proposed", "plan_approved", "mitigated",
                              "plan_reverted"]), " ".join(stages)
    approved = next(e for e in incident["timeline"] if e["stage"] == "plan_approved")
    assert approved["detail"]["by"] == "oncall"
    steps = [(s.action, s.strategy) for s in run.follower.steps]
    assert steps == [("apply", "S3"), ("revert", "S3")], steps
    on = run.follower.steps[0].virtual_s
    slow, mitigated = run.medians(65.0, on - 12.0), run.medians(on + 2.0, 338.0)
    assert mitigated < 0.6 * slow, (slow, mitigated)


def _in_order(stages: list[str], order: list[str]) -> bool:
    """``order`` appears in ``stages`` as a subsequence."""
    it = iter(stages)
    return all(any(s == want for s in it) for want in order)


def test_kill9_of_the_planner_with_s2_in_force_loses_and_repeats_nothing(mstack: Stack) -> None:
    """The planner killed (SIGKILL) once the job runs S2 and before the fault ends, restarted as
    its supervisor would: the run ends as the undisturbed one above (one S2 plan, applied and
    reverted once, each timeline step once, two versions each applied once by the job)."""
    run = Run(mstack, "mitigate-gpu-16")
    log_path = Path(mstack.settings.data_dir) / "logs" / "planner.log"
    killed: list[tuple[int, str, float]] = []  # (log offset, plan's status, virtual s)

    def kill(r: Run) -> None:
        s2 = _plan(r, "S2")
        if killed or s2 is None or s2["status"] != "applied":
            return
        offset = log_path.stat().st_size
        kill9(mstack, "planner")
        restart(mstack, "planner")
        killed.append((offset, s2["status"], r.sim.virtual_s))

    def done(r: Run) -> bool:
        s2 = _plan(r, "S2")
        return bool(killed and s2 and s2["status"] == "reverted" and r.named()
                    and r.named()[0]["status"] == "resolved" and _ran_revert(r))

    run.play(done, on_poll=kill)
    assert killed, run.describe()
    offset, status, at_s = killed[0]
    assert status == "applied" and at_s < 220.0, killed  # in force, the fault still on
    (incident,) = run.named()
    assert incident["kind"] == "compute_slow" and incident["culprit"]["ranks"] == [2], \
        run.describe()
    (s2,) = run.plans
    assert s2["strategy"] == "S2" and s2["policy"] == "automatic", run.describe()
    assert s2["status"] == "reverted" and s2["cost_s"] == 0.5, run.describe()
    assert [a["approver"] for a in s2["approvals"]] == ["policy"]
    stages = [e["stage"] for e in incident["timeline"]]
    print(f"\n  killed at {at_s:.0f} s virtual; timeline: {' '.join(stages)}")
    # as undisturbed: re-checks add validations (and the plan's recovery a detection); every
    # other step once, in order
    for stage in ("localized", "plan_proposed", "plan_approved", "mitigated", "plan_reverted",
                  "resolved"):
        assert stages.count(stage) == 1, " ".join(stages)
    assert _in_order(stages, ["detected", "localized", "validated", "plan_proposed",
                              "plan_approved", "mitigated"]), " ".join(stages)
    assert {"plan_reverted", "resolved"} <= set(stages[stages.index("mitigated"):]), stages
    # the job ran version 1 (apply) and version 2 (revert), each once, and nothing after
    steps = [(s.version, s.action, s.strategy) for s in run.follower.steps]
    assert steps == [(1, "apply", "S2"), (2, "revert", "S2")], steps
    current = run.get(f"/v1/jobs/{run.job}/plan")
    assert current["version"] == 2 and current["microbatches"] is None, current
    # the restarted planner took the escalation up and ended it: the revert is its doing
    after = log_path.read_bytes()[offset:].decode(errors="replace")
    print("  the restarted planner:\n    " + "\n    ".join(
        line[:200] for line in after.splitlines() if run.job in line or "restored" in line))
    assert f"incident {incident['id']} of job {run.job}: escalation restored" in after, after
    assert f"plan {s2['id']} (S2) on job {run.job}: reverted as version 2" in after, after
    # and it did not take the recovery S2 brought for the fault's end: a recovery it judged so
    # left the level under the plan, not the slow one before it
    on = next(s.virtual_s for s in run.follower.steps if s.action == "apply")
    slow, mitigated = run.medians(65.0, on - 1.0), run.medians(on + 2.0, 218.0)
    for m in re.finditer(rf"job {run.job}: recovery ([0-9.]+)s -> [0-9.]+s is the fault's end",
                         after):
        left = float(m.group(1))
        assert abs(left - mitigated) < abs(left - slow), (m.group(0), slow, mitigated)
