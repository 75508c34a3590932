"""Request and response models of the REST API (responses built from ORM rows or core results,
never hand-built dicts), with the examples the OpenAPI shows."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AnyHttpUrl,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from services.api.errors import storable_text
from services.api.tokens import Role, check_scope
from services.common.db.documents import Document
from services.common.webhooks.payload import EVENTS, Format

JobState = Literal["healthy", "slow", "hung"]


def _stored(value: Any) -> Any:
    """A typed document (services.common.db.documents) as it is stored: the keys its writer
    set, so an answer shows what the service recorded and no defaults it left out."""
    return value.as_json() if isinstance(value, Document) else value


# A document column as the API serves it.
Stored = Annotated[dict[str, Any], BeforeValidator(_stored)]
# What audit entries are about (every ``repo.audit(target_type=...)`` names one of these).
AuditTarget = Literal["incident", "job", "plan", "token", "webhook"]


class TimelineEntry(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    stage: str = Field(examples=["localized"])
    at: datetime
    detail: Stored


class CostOut(BaseModel):
    """GPU-hours lost = lost_fraction x gpus x duration_s / 3600, the loss integrated over the
    job's iteration-time levels during the incident (greyhound.core.incident_cost)."""

    model_config = ConfigDict(from_attributes=True)

    gpus: int | None = Field(examples=[256])
    slowdown: float | None = Field(description="the job's iteration time now (its newest level) "
                                   "over its healthy one", examples=[1.5])
    peak_slowdown: float | None = Field(default=None, description="the worst level over healthy",
                                        examples=[3.06])
    lost_fraction: float | None = Field(description=(
        "the share of the GPUs' time lost over the incident: the mean of 1 - healthy/level "
        "over its duration; 1 for a hang"), examples=[0.333])
    onset_at: datetime
    duration_s: float = Field(examples=[1800.0])
    ongoing: bool
    detection_latency_s: float | None = Field(examples=[4.2])
    gpu_hours_lost: float | None = Field(examples=[42.7])
    mitigated_at: datetime | None = Field(default=None,
                                          description="when the first plan took effect")
    gpu_hours_saved: float | None = Field(default=None, description=(
        "what the plans saved: the loss at the level each found, from the first taking effect "
        "to the last taken back, minus the loss measured then and their application cost; null "
        "without a plan"), examples=[12.5])


class IncidentOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str = Field(examples=["3f2a9c0d6b1e4f7a8c9d0e1f2a3b4c5d"])
    job_id: str = Field(examples=["gpt-40b"])
    kind: str = Field(examples=["compute_slow"])
    status: str = Field(examples=["validated"])
    severity: float = Field(examples=[1.5])
    summary: str = Field(examples=["job gpt-40b compute straggler (1.50x); ranks [2]"])
    culprit: Stored = Field(examples=[{"ranks": [2], "gpus": [
        {"rank": 2, "node": 0, "host": "node-a", "device": 2}]}])
    evidence: Stored
    opened_at: datetime
    updated_at: datetime
    resolved_at: datetime | None
    acknowledged_at: datetime | None = None
    acknowledged_by: str | None = None
    suspected_at: datetime | None = Field(default=None, description=(
        "a slowdown's first suspicion; it may be profiled from then on"))
    confirmed_at: datetime | None = Field(default=None, description=(
        "when it was confirmed (it had held): only then may it be validated, which pauses the "
        "job; null while only suspected, and on incidents from before there were two stages"))
    suspected_iteration: int | None = None
    confirmed_iteration: int | None = None
    timeline: list[TimelineEntry]
    cost: CostOut | None = None
    explanation: str | None = Field(default=None, examples=[
        "GPU 3 on node-2 (rank 3) is thermally throttled (SM clock 1095 MHz vs 1980 MHz on its "
        "peers; 87 C)"], description="what the GPUs' own health (NVML) says caused it, if anything")

    @model_validator(mode="after")
    def _explanation(self) -> IncidentOut:
        """Kept in the evidence (no column of its own): the analyzer and validator write it."""
        if self.explanation is None and isinstance(self.evidence.get("explanation"), str):
            self.explanation = self.evidence["explanation"]
        return self


class ApprovalOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    decision: str = Field(examples=["approve"])
    approver: str = Field(examples=["alice"])
    comment: str
    at: datetime


class PlanOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    incident_id: str
    job_id: str
    strategy: str = Field(examples=["S2"])
    params: Stored = Field(examples=[{"kind": "microbatch", "microbatches": [6, 6, 4, 8]}])
    params_version: int = 1
    status: str = Field(examples=["proposed"], description=(
        "proposed, approved, rejected, expired, applied, failed, reverted or withdrawn"))
    policy: str = Field(default="approval", examples=["automatic"])
    expected_gain: float | None = Field(examples=[1.31])
    created_at: datetime
    expires_at: datetime | None = None
    version: int | None = Field(default=None, description="the job's delivery that carried it")
    applied_at: datetime | None
    cost_s: float | None = Field(default=None, description="what applying it cost, as reported")
    reverted_at: datetime | None = None
    reason: str = ""
    approvals: list[ApprovalOut]
    decided_by: str | None = Field(default=None, examples=["alice"], description=(
        "who approved or rejected it (an operator, or `policy` for an automatic plan)"))
    expires_in_s: float | None = Field(default=None, examples=[612.4], description=(
        "a proposal's seconds left to decide, as of this answer (null once decided)"))

    @model_validator(mode="after")
    def _decision(self) -> PlanOut:
        if self.decided_by is None and self.approvals:
            self.decided_by = self.approvals[-1].approver
        if self.status == "proposed" and self.expires_at is not None:
            self.expires_in_s = max((self.expires_at - datetime.now(UTC)).total_seconds(), 0.0)
        return self


class AuditOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    at: datetime
    actor: str = Field(examples=["alice"])
    action: str = Field(examples=["incident.close"])
    target_type: str = Field(examples=["incident"])
    target_id: str
    note: str = Field(examples=["rebooted node-a, GPU 2 replaced"])
    detail: dict[str, Any]


class IncidentDetailOut(IncidentOut):
    plans: list[PlanOut] = []
    audit: list[AuditOut] = []


class Input(BaseModel):
    """A request body: unknown fields rejected, and every string storable in Postgres."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="after")
    @classmethod
    def _storable(cls, v: Any) -> Any:
        for s in (v if isinstance(v, list) else [v]):
            why = storable_text(s) if isinstance(s, str) else None
            if why is not None:
                raise ValueError(why)
        return v


class Note(Input):
    """Why: recorded in the incident's timeline and the audit log."""

    note: str = Field(default="", max_length=2000, examples=["looking into it"])


class RequiredNote(Input):
    note: str = Field(min_length=1, max_length=2000, examples=["GPU 2 on node-a replaced"])


class RankOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    rank: int
    host: str
    node: int | None
    device: int
    pid: int
    agent_id: str
    last_seen_at: datetime


class RankStateOut(RankOut):
    last_iteration: int | None = Field(examples=[1234])
    last_iteration_s: float | None = Field(examples=[0.412])
    last_iteration_at: datetime | None
    state: Literal["ok", "slow", "stale", "suspect", "unknown"] = Field(
        description="suspect: named by an open, localised incident; slow: newest iteration > 1.1x the job's "
                    "median; stale: no iteration for 10 iterations (30 s at least); unknown: "
                    "no iteration in the window")


class JobOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str = Field(examples=["gpt-40b"])
    world_size: int | None = Field(examples=[256])
    topology: Stored = Field(examples=[{"layout": {"tp": 8, "dp": 16, "pp": 2, "gpus_per_node": 8,
                                                   "microbatches": 64}}])
    first_seen_at: datetime
    last_seen_at: datetime
    state: JobState = "healthy"
    open_incidents: int = 0
    ranks_known: int = 0


class JobDetailOut(JobOut):
    ranks: list[RankOut]


class JobPlanOut(BaseModel):
    """What the job must run now: its newest delivery (version 0 and nulls: its own layout)."""

    job_id: str
    version: int = Field(examples=[3], description="a job applies a version above the one it runs")
    plan_id: str | None = None
    incident_id: str | None = None
    strategy: str | None = Field(default=None, examples=["S2"])
    action: Literal["apply", "revert"] | None = None
    microbatches: list[int] | None = Field(default=None, examples=[[5, 3, 4, 4]], description=(
        "micro-batches per DP group; null: the job's own even split"))
    gpu_of_rank: list[int] | None = Field(default=None, description=(
        "the GPU each rank runs on; null: every rank on its own GPU"))
    swaps: list[tuple[int, int]] = Field(default_factory=list, description=(
        "GPU pairs that exchange ranks, in order, from the previous version"))
    cost_s: float | None = None
    summary: str = ""
    issued_at: datetime | None = None
    reported: str | None = Field(default=None, description="the job's report on it, if any")


class PlanReportIn(Input):
    """The job applied (or could not apply) a delivered version."""

    version: int = Field(ge=1, le=2**31 - 1, examples=[3])
    outcome: Literal["applied", "failed"] = "applied"
    cost_s: float | None = Field(default=None, ge=0, le=1e7, examples=[0.4], description=(
        "seconds of training time applying it cost (the planner learns overheads from it)"))
    error: str | None = Field(default=None, max_length=2000)


class PlanReportAccepted(BaseModel):
    job_id: str
    version: int
    outcome: str
    event_id: str


class TimelineMarker(BaseModel):
    at: datetime = Field(description="an incident's estimated onset; a plan's creation")
    until: datetime | None = Field(default=None, description="an incident's resolution")
    kind: Literal["incident", "plan"]
    id: str
    label: str
    status: str


class TimelineOut(BaseModel):
    job_id: str
    start: datetime
    bucket_s: float
    times: list[float] = Field(description="bucket starts, Unix seconds")
    median_s: list[float | None] = Field(description="median iteration time per bucket")
    max_s: list[float | None]
    ranks: list[int]
    heat: list[list[float | None]] = Field(description="ranks x buckets")
    heat_basis: Literal["lateness", "slowdown", "none"]
    heat_unit: str
    markers: list[TimelineMarker]
    truncated: bool = Field(description="the read stopped at its message cap")
    telemetry_error: str | None = None


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class Readiness(BaseModel):
    status: Literal["ready", "not ready"]
    checks: dict[str, str] = Field(examples=[{"database": "ok", "nats": "ok"}])


class TokenOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str = Field(examples=["ci-bot"])
    role: Role
    job_id: str | None = Field(default=None, description="a job token's job (None otherwise)")
    prefix: str = Field(examples=["gh_Zx81kPq"])
    created_by: str
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    last_used_at: datetime | None


class TokenCreated(TokenOut):
    token: str = Field(description="the secret, shown this once; only its hash is stored")


class TokenIn(Input):
    name: str = Field(min_length=1, max_length=255, pattern=r"^[\w.@ -]+$", examples=["oncall-bot"])
    role: Role = Field(examples=["operator"])
    job_id: str | None = Field(default=None, max_length=128, description=(
        "the job a job token acts for (required for the job role, refused for the others)"))
    expires_in_days: float | None = Field(default=None, gt=0, le=3650, examples=[90])

    @model_validator(mode="after")
    def _scope(self) -> TokenIn:
        check_scope(self.role, self.job_id)
        return self


class Me(BaseModel):
    name: str
    role: Role
    token_id: str | None
    job_id: str | None = None


EventName = Literal[EVENTS]  # type: ignore[valid-type]


class WebhookIn(Input):
    name: str = Field(default="", max_length=255, examples=["oncall-slack"])
    url: AnyHttpUrl = Field(examples=["https://hooks.example.org/services/T000/B000/XXXX"])
    events: list[EventName] = Field(default_factory=list, max_length=len(EVENTS), description=(
        "events to receive; empty: every incident and plan event"),
        examples=[["incident.opened", "incident.validated", "incident.resolved"]])
    format: Format = Field(default="json", description="json: the full document; slack: text and "
                           "blocks only (a Slack incoming webhook)")
    secret: str | None = Field(default=None, min_length=16, max_length=255, description=(
        "signing secret; omitted: the server makes one and returns it once"))


class WebhookOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str
    url: str
    events: list[str]
    format: str
    enabled: bool
    created_by: str
    created_at: datetime


class WebhookCreated(WebhookOut):
    secret: str = Field(description="the signing secret, shown this once (stored encrypted)")


class AttemptOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    at: datetime
    outcome: str = Field(examples=["delivered"])
    status_code: int | None = Field(examples=[200])
    error: str | None
    duration_ms: float


class DeliveryOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    event_id: str = Field(description="the idempotency key (Greyhound-Delivery header)")
    event: str
    incident_id: str | None
    status: str = Field(examples=["delivered"], description=(
        "pending (due at next_attempt_at), sending (claimed by a notifier until "
        "next_attempt_at), delivered, failed (given up), held (a stage of a slowdown only "
        "suspected so far: sent once it is confirmed) or withdrawn (held, and the suspicion was "
        "withdrawn: never sent)"))
    attempts: int
    last_error: str | None
    next_attempt_at: datetime | None
    created_at: datetime
    delivered_at: datetime | None
    attempt_log: list[AttemptOut] = []


class SightingOut(BaseModel):
    incident_id: str
    job_id: str
    kind: str
    opened_at: datetime
    confirmed: bool


class ComponentOut(BaseModel):
    kind: Literal["gpu", "node", "link"]
    id: str = Field(examples=["node-a:2"])
    host: str | None
    device: int | None
    advice: Literal["drain", "watch", "ok"]
    reason: str = Field(examples=["3 confirmed incidents in 2 jobs (rule: >= 3 in >= 2 jobs)"])
    confirmed: int
    incidents: int
    jobs: list[str]
    last_at: datetime
    history: list[SightingOut]


class FleetOut(BaseModel):
    window_days: float
    drain_rule: str
    components: list[ComponentOut]
