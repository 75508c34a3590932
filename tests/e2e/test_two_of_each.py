"""Two of every central service on a 3-node NATS cluster, kill -9 of one instance of each and of
one NATS node mid-run: nothing lost, nothing done twice (issue 21's end-to-end test).

The system runs as tests/e2e/two_of_each.py sets it up: three nats-server nodes routed to each
other on loopback (every stream with three copies), Postgres, the services started as
``greyhound up`` starts them (one agent for the simulated nodes), the API instances behind a load
balancer, a webhook receiver on loopback registered for every event. The live simulator plays 64
GPUs (TP8 DP4 PP2, 8 nodes) through it, with three faults one after the other:

* GPU 9 runs 2x slower from 30 s to 120 s (virtual): compute_slow on rank 9, validated on its
  GPU; the planner's automatic S2 (micro-batches moved off its DP group), which the simulated
  job applies as plan version 1, then takes it back as version 2 once the GPU is healthy; the
  incident resolved;
* the link between nodes 4 and 5 congested 4x from 175 s to 235 s: comm_slow naming the link,
  validated, resolved (no plan: S2 cannot help a link and S3's overhead is set out of reach);
* rank 5's GPU never completes a collective from 290 s on: hang_hardware on rank 5 (the
  scenario says "collective": the first call of rank 5's GPU at 290 s was a pipeline send in
  one CI run, which only the pair 5-37 can be named for, and the runs differed).

First undisturbed, with one instance of each service. Then, on the same cluster and database, a
second instance of each is started and the scenario is played again as another job while one
instance of each is killed with SIGKILL at the moment it matters, and never restarted (its
twin carries on), and the node leading the telemetry stream is killed too:

* the tracker (the lease holder: it ran alone before) just after the link congested, before
  it saw the slowdown; the standby takes the partition's lease, loads the job's saved state and
  reads back the telemetry it did not hold (a tracker killed before a job's first save, in its
  first 5 s, would leave the standby to start that job afresh, without its healthy level: not
  this test's subject);
* the analyzer once the GPU's incident is open (mid-localisation);
* the validator once it asked the job to pause (mid-validation, the job parked);
* the planner once the job runs S2 (the escalation in force, its revert to come);
* the notifier once the link's incident is open (its webhooks being sent);
* the NATS node leading the telemetry stream once the link's incident is validated;
* the first API instance once the hang began (the balancer sends every request to the other).

The disturbed run must end as the undisturbed one, compared by meaning, not by timing: the same
incidents (kind, culprit, each stage as often: once, but for the validations a plan's re-check
adds), the same plans (strategy, policy, status, each step of their timeline once), the plan
versions the job applied (each once, in order), and the webhooks: each event the receiver
processed once (one idempotency key per event, and every incident stage and plan step that has
an event delivered), the same events as undisturbed. Delivery is at least once
(docs/webhooks.md): a notifier killed mid-send sends its delivery again at its lease's end, and
the receiver's documented check drops the key it processed; such resends are printed, not
counted as duplicates.

The analyzer and the planner are two only by their per-job leases (the second a hot standby,
docs/scaling.md). Before those, both consumed, and this test failed as it should: a live twin's
resume pass localised again what the other was localising (two "localized" stages and
webhooks), or the planner that did not hold the escalation never took it up when its holder
died (S2 never reverted, the incident left mitigated).

Pacing (greyhound.sim.live): at FAST x virtual time while nothing is open; at SLOW x from a few
seconds before each fault until its phase is over (the GPU's: the incident resolved and S2 taken
back and run; the link's: resolved; the hang: named) and while the services profile or pause the
job, so that their wall-clock work (a profiling window, a validation's pause, a plan's delivery,
a re-check every RECHECK_S) lands in the same virtual phase in both runs. About 2 1/2 minutes
for both runs on a busy 2-core machine.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from greyhound.integrations.rest import PlanClient
from greyhound.sim.live import LiveSimulation
from greyhound.sim.scenario import Scenario, parse_scenario
from services.analyzer.settings import AnalyzerSettings
from services.api.settings import ApiSettings
from services.api.tokens import token_key
from services.common.bus.client import connect
from services.common.bus.streams import TELEMETRY
from services.common.settings import Settings
from services.notifier.settings import NotifierSettings
from services.planner.settings import PlannerSettings
from services.tracker.settings import TrackerSettings
from services.validator.settings import ValidatorSettings
from stack.lag import TrackerLag
from stack.sim_plans import SimPlanFollower, Step, mint_token
from stack.up import Stack, wait_api
from tests.conftest import TEST_TOKEN_KEY, new_database
from tests.e2e.faults import kill9
from tests.e2e.story import job_story
from tests.e2e.two_of_each import CENTRAL, ThreadedReceiver, balanced, dump
from tests.services.common.test_nats_cluster import Cluster, _until_ready, nats_cluster
from tests.services.notifier.receiver import free_port

pytestmark = pytest.mark.timeout(600)

SLOW_GPU, LINK, HUNG = 9, [4, 5], 5
GPU_AT, GPU_END, LINK_AT, LINK_END, HANG_AT = 30.0, 120.0, 175.0, 235.0, 290.0
FAST, SLOW = 25.0, 4.0
LEAD_S = 3.0  # virtual seconds before a fault's onset at which the pace slows
LAG_HIGH = 200  # telemetry messages the tracker has not consumed: above, the run goes at 1x
RECHECK_S = 6.0
HANG_FLOOR_S = 15.0  # virtual (the simulator shows a pending call's age in virtual time)
WEBHOOK_SECRET = "whsec-two-of-each-0123456789"
# Stages that happen once in an incident's life; a plan's re-check adds validations (and may
# find the GPU healthy again), so "validated" is compared as present, not counted.
ONCE = ("localized", "plan_proposed", "plan_approved", "mitigated", "plan_reverted", "resolved")


def _scenario() -> Scenario:
    return parse_scenario({
        "name": "two-of-each",
        "job": {"tp": 8, "dp": 4, "pp": 2, "gpus_per_node": 8, "microbatches": 16,
                "microbatch_compute_s": 0.04, "dp_allreduce_bytes": 1.0e9,
                "pp_activation_bytes": 2.0e7, "link_gbps": 400, "nvlink_gbps": 3600},
        "duration_s": HANG_AT + 60.0, "seed": 21,
        "noise": {"jitter_cv": 0.01, "gc_prob": 0.0},
        "costs": {"microbatch_s": 0.5, "reconfigure_s": 10.0, "restart_s": 1800.0},
        "faults": [
            {"kind": "gpu_slow", "rank": SLOW_GPU, "start_s": GPU_AT, "factor": 2.0,
             "duration_s": GPU_END - GPU_AT},
            {"kind": "link_congestion", "nodes": LINK, "start_s": LINK_AT, "factor": 4.0,
             "duration_s": LINK_END - LINK_AT},
            {"kind": "hang_hardware", "rank": HUNG, "start_s": HANG_AT, "call": "collective"},
        ]})


@dataclass
class Rig:
    stack: Stack
    cluster: Cluster
    receiver: ThreadedReceiver
    api_ports: list[int]
    admin: str = ""  # an admin's token (the webhooks and their deliveries)
    killed: set[str] = field(default_factory=set)
    twin_log_at: dict[str, int] = field(default_factory=dict)  # its twin's log size at a kill

    def twin_log(self, name: str) -> Path:
        return self.stack.log_path(f"{name}-2")

    def after_kill(self, name: str) -> str:
        """What the killed instance's twin logged since the kill."""
        with self.twin_log(name).open("rb") as f:
            f.seek(self.twin_log_at[name])
            return f.read().decode(errors="replace")

    @property
    def bases(self) -> list[str]:
        """Every API instance's address (the balancer passes over a killed one)."""
        return [f"http://127.0.0.1:{p}" for p in self.api_ports]

    def second_instances(self) -> None:
        """A second instance of every central service, beside the first."""
        port = free_port()
        for name in CENTRAL:
            self.stack.spawn(name, instance=2, port=port if name == "api" else None)
        self.api_ports.append(port)
        wait_api(f"http://127.0.0.1:{port}")

    def kill_nats_leader(self) -> str:
        """SIGKILL the node that leads the telemetry stream; its name."""
        async def leader() -> str:
            nc = await connect(self.cluster.url, name="two-of-each-probe")
            try:
                info = await nc.jetstream().stream_info(TELEMETRY)
                assert info.cluster is not None and info.cluster.leader is not None
                return str(info.cluster.leader)
            finally:
                await nc.close()

        name = asyncio.run(leader())
        port = int(self.cluster.urls[int(name.removeprefix("n"))].rpartition(":")[2])
        self.cluster.kill(port)
        return name


@pytest.fixture(scope="module")
def rig(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    root = tmp_path_factory.mktemp("two-of-each")
    with nats_cluster() as cluster, new_database(pg_url, "two") as db_url:
        asyncio.run(_until_ready(cluster.url))
        settings = Settings(
            nats_url=cluster.url, stream_replicas=3, database_url=db_url,
            token_key=TEST_TOKEN_KEY, webhook_key="two-of-each-webhook-key-0123456789",
            webhook_allow_hosts="127.0.0.1", webhook_timeout_s=2.0,
            data_dir=root / "data", shm_dir=root / "shm", outbox_poll_s=0.5,
            outbox_grace_s=1.0, telemetry_max_bytes=256 * 1024**2,
            # 13 processes on one Postgres (docs/scaling.md, "A cluster: Postgres")
            database_pool_size=2, database_max_overflow=2)
        port = free_port()
        stack = Stack(settings, port=port, services=("agent", *CENTRAL), service_settings=(
            TrackerSettings(hang_floor_s=HANG_FLOOR_S),
            AnalyzerSettings(resume_every_s=2.0),
            ValidatorSettings(claim_lease_s=3.0, resume_every_s=0.5, unclaimed_after_s=20.0),
            PlannerSettings(s2_overhead_s=2.0, s3_overhead_s=1e6, s4_overhead_s=1e6,
                            recheck_s=RECHECK_S, poll_s=0.2, proposal_ttl_s=300.0,
                            hold_max_s=0.0),
            NotifierSettings(webhook_backoff_base_s=0.2, webhook_backoff_max_s=1.0,
                             notifier_poll_s=0.1),
            ApiSettings(api_anonymous_role="viewer")))
        receiver = ThreadedReceiver(WEBHOOK_SECRET)
        try:
            stack.start()
            wait_api(f"http://127.0.0.1:{port}")
            r = Rig(stack, cluster, receiver, [port])
            _register_webhook(r)
            yield r
        finally:
            stack.stop()
            receiver.close()


def _register_webhook(rig: Rig) -> None:
    assert rig.stack.backends is not None
    rig.admin = mint_token(rig.stack.backends.database_url, role="admin",
                           name="two-of-each-admin", token_key=token_key(rig.stack.settings))
    with balanced(rig.bases) as http:
        r = http.post("/v1/webhooks", json={"name": "oncall", "url": rig.receiver.url,
                                            "secret": WEBHOOK_SECRET},
                      headers={"Authorization": f"Bearer {rig.admin}"})
        assert r.status_code == 201, r.text


@dataclass
class Kill:
    """kill -9 of ``key`` (a service instance, or "nats" for the telemetry stream's leader),
    the first time ``when`` holds."""

    key: str
    when: Callable[[Run], bool]
    at_s: float | None = None


@dataclass
class Outcome:
    incidents: list[dict[str, Any]]
    plans: list[dict[str, Any]]
    steps: list[Step]
    webhooks: list[dict[str, Any]]
    duplicates: list[str]
    phases: dict[str, float]  # virtual s at which each fault's phase was seen over
    wall_s: float

    def phases_in_turn(self) -> bool:
        """Each fault's phase was over before the next fault began (its pace slowed): the
        faults came one after the other, as in the scenario."""
        p = self.phases
        return (p.get("gpu", 1e9) < LINK_AT - LEAD_S and p.get("link", 1e9) < HANG_AT - LEAD_S
                and "hang" in p)


class Run:
    """One play of the scenario as job ``job``, its plans followed by the simulated job."""

    def __init__(self, rig: Rig, job: str, kills: list[Kill]) -> None:
        self.rig, self.job, self.kills = rig, job, kills
        stack = rig.stack
        assert stack.backends is not None
        self.http = balanced(rig.bases)
        self.sim = LiveSimulation(_scenario(), stack.settings.shm_dir, job, speed=FAST)
        token = mint_token(stack.backends.database_url, role="job", name=job, job_id=job,
                           token_key=token_key(stack.settings))
        self.follower = SimPlanFollower(self.sim, PlanClient("http://api", job, token,
                                                             client=balanced(rig.bases, 5.0)))
        self.incidents: list[dict[str, Any]] = []
        self.plans: list[dict[str, Any]] = []
        self._next_poll = 0.0
        self.phases: dict[str, float] = {}
        self.lag: TrackerLag | None = None

    def get(self, path: str, **params: Any) -> Any:
        r = self.http.get(path, params=params,
                          headers={"Authorization": f"Bearer {self.rig.admin}"})
        r.raise_for_status()
        return r.json()

    def refresh(self) -> None:
        self.incidents = self.get("/v1/incidents", job_id=self.job, limit=100)
        self.plans = self.get("/v1/plans", job_id=self.job)

    # ---- what the run has reached -------------------------------------------------------

    def incident(self, kind: str) -> dict[str, Any] | None:
        return next((i for i in self.incidents if i["kind"].startswith(kind)), None)

    def stages(self, kind: str) -> list[str]:
        i = self.incident(kind)
        return [e["stage"] for e in i["timeline"]] if i else []

    def s2(self) -> dict[str, Any] | None:
        return next((p for p in self.plans if p["strategy"] == "S2"), None)

    def gpu_done(self) -> bool:
        """The GPU's phase is over: its incident resolved, S2 taken back and run by the job."""
        s2 = self.s2()
        reverted = [s for s in self.follower.steps if s.action == "revert"]
        return ("resolved" in self.stages("compute_slow") and s2 is not None
                and s2["status"] == "reverted" and bool(reverted)
                and self.sim.virtual_s > reverted[-1].virtual_s + 2.0)

    def link_done(self) -> bool:
        return "resolved" in self.stages("comm_slow") or "resolved" in self.stages("mixed_slow")

    def link_incident_open(self) -> bool:
        return self.incident("comm_slow") is not None or self.incident("mixed_slow") is not None

    def hang_named(self) -> bool:
        return self.incident("hang") is not None

    def parked(self) -> bool:
        return any(ring.control.pause_requested() for ring in self.sim.rings)

    # ---- the play -----------------------------------------------------------------------

    def pace(self, lag: int | None) -> float:
        """SLOW while a fault's phase is open or the services work on the job, else FAST; 1x
        while the tracker lags (a loaded machine), so that it sees each change in time."""
        if lag is not None and lag > LAG_HIGH:
            return 1.0
        v = self.sim.virtual_s
        phases = [(GPU_AT, self.gpu_done), (LINK_AT, self.link_done),
                  (HANG_AT, self.hang_named)]
        open_ = any(v >= start - LEAD_S and not done() for start, done in phases)
        return SLOW if open_ or self.sim.attended else FAST

    def _should_stop(self) -> bool:
        stack = self.rig.stack
        dead = set(stack.dead()) - self.rig.killed
        assert not dead, f"services died: {sorted(dead)}"
        self.follower.poll()
        if time.monotonic() < self._next_poll:
            return False
        self._next_poll = time.monotonic() + 0.3
        self.refresh()
        for k in self.kills:
            if k.at_s is None and k.when(self):
                k.at_s = self.sim.virtual_s
                if k.key == "nats":
                    print(f"\n  killed NATS node {self.rig.kill_nats_leader()} (the telemetry "
                          f"stream's leader) at {k.at_s:.1f} s virtual")
                else:
                    self.rig.twin_log_at[k.key] = self.rig.twin_log(k.key).stat().st_size
                    kill9(stack, k.key)
                    self.rig.killed.add(k.key)
                    print(f"\n  killed {k.key} at {k.at_s:.1f} s virtual")
                self.refresh()
        self.sim.speed = self.pace(self.lag.pending if self.lag is not None else None)
        for name, done in (("gpu", self.gpu_done), ("link", self.link_done),
                           ("hang", self.hang_named)):
            if name not in self.phases and done():
                self.phases[name] = self.sim.virtual_s
        return len(self.phases) == 3

    def play(self) -> Outcome:
        t0 = time.monotonic()
        with TrackerLag(self.rig.stack) as self.lag:
            try:
                self.follower.start()
                self.sim.run(should_stop=self._should_stop)
                self.follower.poll()
                self._settle_webhooks()
                self.refresh()
            finally:
                self.sim.close(remove=True)
        for k in self.kills:
            assert k.at_s is not None, f"kill of {k.key} never happened"
        return Outcome(self.incidents, self.plans, list(self.follower.steps),
                       self.rig.receiver.of_job(self.job), self.rig.receiver.duplicates(),
                       dict(self.phases), time.monotonic() - t0)

    def _settle_webhooks(self, timeout_s: float = 60.0) -> None:
        """Until no delivery of the job is pending and nothing new arrived for a while (a
        notifier killed mid-send leaves its delivery leased for its deadline and 30 s)."""
        deadline = time.monotonic() + timeout_s
        seen, quiet_since = -1, time.monotonic()
        while time.monotonic() < deadline:
            hooks = self.get("/v1/webhooks")
            pending = [d for h in hooks for d in self.get(f"/v1/webhooks/{h['id']}/deliveries",
                                                          limit=500)
                       if d["status"] not in ("delivered", "failed", "rejected", "withdrawn")]
            n = len(self.rig.receiver.of_job(self.job))
            if n != seen:
                seen, quiet_since = n, time.monotonic()
            if not pending and time.monotonic() - quiet_since > 3.0:
                return
            time.sleep(0.5)


# ---- the comparison -------------------------------------------------------------------------


def _culprit(c: dict[str, Any]) -> tuple[Any, ...]:
    return (tuple(c.get("ranks") or []), tuple(g["rank"] for g in c.get("gpus") or []),
            tuple(tuple(x) for x in c.get("links") or []))


def incident_summary(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Each incident's kind, status, culprit, the stages it went through and how often each
    once-stage happened."""
    out = []
    for r in rows:
        stages = [e["stage"] for e in r["timeline"]]
        counts = Counter(stages)
        out.append((r["kind"], r["status"], _culprit(r["culprit"]), tuple(sorted(counts)),
                    tuple((s, counts[s]) for s in ONCE if s in counts)))
    return sorted(out)


def plan_summary(plans: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return sorted((p["strategy"], p["policy"], p["status"],
                   tuple(a["approver"] for a in p["approvals"])) for p in plans)


def steps_summary(steps: list[Step]) -> list[tuple[Any, ...]]:
    return [(s.version, s.action, s.strategy, s.error) for s in steps]


def webhook_summary(o: Outcome) -> list[tuple[str, str]]:
    """The events received: name and what they are about (the incident's kind as the run ended,
    the plan's strategy), sorted; repeated events (a re-check's validations) counted apart.
    The incident's final kind, not the one in the message: a message says what the incident
    knew when it was sent, so an opening announced after the localisation (its confirmation
    came later, as when the tracker was killed) already names the kind the localisation found,
    one announced before it the tracker's ``slowdown``."""
    kinds = {i["id"]: i["kind"] for i in o.incidents}
    out = []
    for b in o.webhooks:
        inc, plan = b.get("incident") or {}, b.get("plan") or {}
        about = kinds.get(inc.get("id"), inc.get("kind")) if inc else plan.get("strategy")
        out.append((b["event"], str(about)))
    return sorted(set(out))


def check_webhooks(o: Outcome) -> None:
    """Each event processed once (one idempotency key each: the receiver processes a key
    once), and every incident stage and plan step that has an event (docs/webhooks.md) has
    one delivered: none lost, none duplicated (a second key for one event)."""
    keys = [b["id"] for b in o.webhooks]
    assert len(keys) == len(set(keys)), Counter(keys).most_common(3)
    got = Counter(f"{b['event']} {(b.get('incident') or b.get('plan') or {}).get('id')}"
                  for b in o.webhooks)
    want: Counter[str] = Counter()
    for i in o.incidents:
        stages = [e["stage"] for e in i["timeline"]]
        want[f"incident.opened {i['id']}"] = 1  # a hang named as it opens too
        for stage in ("localized", "validated", "mitigated", "resolved"):
            if stage in stages:
                want[f"incident.{stage} {i['id']}"] = stages.count(stage)
    for p in o.plans:
        want[f"plan.proposed {p['id']}"] = want[f"plan.approved {p['id']}"] = 1
        if p["applied_at"]:
            want[f"plan.applied {p['id']}"] = 1
        if p["status"] == "reverted":
            want[f"plan.reverted {p['id']}"] = 1
    assert got == want, dump({"missing": want - got, "extra": got - want,
                              "events": sorted(got.items())})


@pytest.fixture(scope="module")
def undisturbed(rig: Rig) -> Outcome:
    return Run(rig, f"calm-{uuid.uuid4().hex[:6]}", []).play()


def _report(name: str, o: Outcome) -> None:
    print(f"\n{name}: {o.wall_s:.0f} s wall, phases over at {o.phases} s virtual"
          f"\n  incidents {incident_summary(o.incidents)}"
          f"\n  plans {plan_summary(o.plans)}\n  steps {steps_summary(o.steps)}"
          f"\n  webhooks {sorted(Counter(b['event'] for b in o.webhooks).items())}"
          f"\n  sent again after they were processed (at least once: dropped by the receiver's "
          f"check) {o.duplicates}")


def test_undisturbed_single_instances(undisturbed: Outcome, rig: Rig) -> None:
    o = undisturbed
    _report("undisturbed", o)
    Path(rig.stack.settings.data_dir, "undisturbed.json").write_text(dump(o.__dict__))
    assert o.phases_in_turn(), o.phases
    kinds = {r[0]: r for r in incident_summary(o.incidents)}
    assert sorted(kinds) in (["comm_slow", "compute_slow", "hang_hardware"],
                             ["compute_slow", "hang_hardware", "mixed_slow"]), kinds
    gpu = kinds["compute_slow"]
    assert gpu[1] == "resolved" and gpu[2][:2] == ((SLOW_GPU,), (SLOW_GPU,)), gpu
    link = kinds.get("comm_slow") or kinds["mixed_slow"]
    assert link[1] == "resolved" and link[2][2] == (tuple(LINK),), link
    assert kinds["hang_hardware"][2][0] == (HUNG,), kinds["hang_hardware"]
    assert plan_summary(o.plans) == [("S2", "automatic", "reverted", ("policy",))], o.plans
    assert steps_summary(o.steps) == [(1, "apply", "S2", None), (2, "revert", "S2", None)]
    check_webhooks(o)


def test_kill9_of_one_instance_of_each_and_a_nats_node(undisturbed: Outcome, rig: Rig) -> None:
    rig.second_instances()
    kills = [
        Kill("analyzer", lambda r: r.incident("compute_slow") is not None),
        Kill("validator", lambda r: r.parked()),
        Kill("planner", lambda r: (r.s2() or {}).get("status") == "applied"),
        Kill("tracker", lambda r: r.sim.virtual_s >= LINK_AT + 0.5),
        Kill("notifier", lambda r: r.sim.virtual_s >= LINK_AT and r.link_incident_open()),
        Kill("nats", lambda r: "validated" in r.stages("comm_slow") + r.stages("mixed_slow")),
        Kill("api", lambda r: r.sim.virtual_s >= HANG_AT),
    ]
    job = f"kill-{uuid.uuid4().hex[:6]}"
    o = Run(rig, job, kills).play()
    _report("disturbed", o)
    print(job_story(rig.stack.settings.data_dir, job))
    Path(rig.stack.settings.data_dir, "disturbed.json").write_text(dump(o.__dict__))
    assert incident_summary(o.incidents) == incident_summary(undisturbed.incidents), \
        dump([incident_summary(o.incidents), incident_summary(undisturbed.incidents)])
    assert plan_summary(o.plans) == plan_summary(undisturbed.plans), o.plans
    assert steps_summary(o.steps) == steps_summary(undisturbed.steps), o.steps
    check_webhooks(o)
    assert webhook_summary(o) == webhook_summary(undisturbed)
    assert o.phases_in_turn(), o.phases
    # and each kill left work to do, which the killed instance's twin did
    assert f"job {job}: resumed detector state" in rig.after_kill("tracker")
    assert f"localized (job {job}: hang_" in rig.after_kill("analyzer")
    assert f"job {job}: validation comm_slow" in rig.after_kill("validator")
    assert f"on job {job}: reverted as version 2" in rig.after_kill("planner")
    assert ") attempt 1: delivered" in rig.after_kill("notifier")
