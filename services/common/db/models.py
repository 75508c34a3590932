"""The relational model: jobs and their ranks, incidents with timeline and evidence, plans with
their approvals, deliveries and escalation state, webhooks with their deliveries and attempts,
API tokens, the audit log, the processed-event ledger for idempotent consumers, the outbox of
messages that commits announce, and the validator's claims.

Schema changes go through Alembic migrations only (services/common/migrations).
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
    func,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from services.common.bus.contract import PlanMessage
from services.common.db.documents import (
    Culprit,
    Empty,
    Evidence,
    Note,
    PlanParams,
    Topology,
)
from services.common.db.json_document import JsonDocument

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {dict[str, Any]: JSONB, list[Any]: JSONB}  # noqa: RUF012 (SQLAlchemy API)


def _uuid() -> str:
    return uuid.uuid4().hex


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    world_size: Mapped[int | None] = mapped_column(Integer)
    topology: Mapped[Topology] = mapped_column(JsonDocument(Topology), default=lambda: Topology())
    first_seen_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    last_seen_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    # the last plan version handed out to the job (services.common.db.exclusion.next_plan_version):
    # counted here, not read off its deliveries, so it never goes back when retention deletes some
    plan_version: Mapped[int] = mapped_column(Integer, default=0, server_default="0")

    ranks: Mapped[list[Rank]] = relationship(back_populates="job", lazy="raise")


class Rank(Base):
    __tablename__ = "ranks"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    host: Mapped[str] = mapped_column(String(255))
    node: Mapped[int | None] = mapped_column(Integer)
    device: Mapped[int] = mapped_column(Integer)
    # its hook found neither a CUDA runtime nor the driver API: no GPU completion marks, so
    # whatever rests on its GPU times rests on host times (the agent's hello says so)
    marks_off: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    pid: Mapped[int] = mapped_column(Integer)
    agent_id: Mapped[str] = mapped_column(String(128))
    last_seen_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())

    job: Mapped[Job] = relationship(back_populates="ranks", lazy="raise")


class Incident(Base):
    """One ongoing problem of one job; repeated detections of it update this row, not new rows."""

    __tablename__ = "incidents"
    __table_args__ = (
        Index("ix_incidents_job_status", "job_id", "status"),
        Index("uq_incidents_open_dedup", "job_id", "dedup_key", unique=True,
              postgresql_where="status <> 'resolved'"),
        Index("ix_incidents_resolved_at", "resolved_at"),
        # No NaN, no infinity: JSON has neither, so the API could not serve the row.
        CheckConstraint("severity >= 0 AND severity < 'Infinity'::float8", name="severity_finite"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=_uuid)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(32), default="detected")
    dedup_key: Mapped[str] = mapped_column(String(255))
    severity: Mapped[float] = mapped_column(Float, default=1.0)
    summary: Mapped[str] = mapped_column(Text, default="")
    culprit: Mapped[Culprit] = mapped_column(JsonDocument(Culprit), default=lambda: Culprit())
    evidence: Mapped[Evidence] = mapped_column(JsonDocument(Evidence),
                                               default=lambda: Evidence())
    opened_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now(),
                                                 onupdate=func.now())
    resolved_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    acknowledged_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    acknowledged_by: Mapped[str | None] = mapped_column(String(255))
    # A slowdown's two moments (greyhound.core.levels): suspected, then confirmed once it held.
    # Only suspected (confirmed_at NULL): it may be profiled, never validated (a pause).
    suspected_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    confirmed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    suspected_iteration: Mapped[int | None] = mapped_column(BigInteger)
    confirmed_iteration: Mapped[int | None] = mapped_column(BigInteger)

    @property
    def only_suspected(self) -> bool:
        """A slowdown suspected and not (yet) confirmed; rows from before there were two stages
        have neither moment and count as confirmed."""
        return self.suspected_at is not None and self.confirmed_at is None

    # one transaction's entries share ``at`` (the transaction's now()): the id keeps their order
    timeline: Mapped[list[IncidentEvent]] = relationship(
        back_populates="incident", lazy="raise", order_by="[IncidentEvent.at, IncidentEvent.id]")


class IncidentEvent(Base):
    """The incident's timeline: detected, localized, validated, mitigated, resolved."""

    __tablename__ = "incident_events"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    incident_id: Mapped[str] = mapped_column(ForeignKey("incidents.id", ondelete="CASCADE"),
                                             index=True)
    stage: Mapped[str] = mapped_column(String(32))
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    detail: Mapped[Note] = mapped_column(JsonDocument(Note), default=lambda: Empty())

    incident: Mapped[Incident] = relationship(back_populates="timeline", lazy="raise")


# a plan not final yet (greyhound.core.plan_lifecycle): at most one per incident and strategy
OPEN_PLAN_STATUSES = ("proposed", "approved", "applied")
OPEN_PLAN = "status IN ({})".format(", ".join(f"'{s}'" for s in OPEN_PLAN_STATUSES))


class Plan(Base):
    """A mitigation the planner proposes (S2 micro-batches, S3 topology, S4 restart); its status
    moves as greyhound.core.plan_lifecycle says. ``policy`` is how it was decided (``automatic``:
    approved by the policy itself, ``approval``: an operator's call); ``version`` is the job's
    delivery that put it in force; ``params`` follow ``params_version`` (docs/mitigation.md).
    An incident has at most one open plan (proposed, approved or applied) per strategy, however
    many planners propose: ``uq_plans_open_strategy``."""

    __tablename__ = "plans"
    __table_args__ = (
        Index("ix_plans_job_status", "job_id", "status"),
        Index("uq_plans_open_strategy", "incident_id", "strategy", unique=True,
              postgresql_where=OPEN_PLAN),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=_uuid)
    incident_id: Mapped[str] = mapped_column(ForeignKey("incidents.id", ondelete="CASCADE"),
                                             index=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    strategy: Mapped[str] = mapped_column(String(32))
    params: Mapped[PlanParams] = mapped_column(JsonDocument(PlanParams))
    params_version: Mapped[int] = mapped_column(Integer, default=1)
    status: Mapped[str] = mapped_column(String(32), default="proposed")
    policy: Mapped[str] = mapped_column(String(16), default="approval")
    expected_gain: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    version: Mapped[int | None] = mapped_column(Integer)
    applied_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cost_s: Mapped[float | None] = mapped_column(Float)
    reverted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    reason: Mapped[str] = mapped_column(Text, default="")

    approvals: Mapped[list[Approval]] = relationship(back_populates="plan", lazy="raise")


class PlanDelivery(Base):
    """Every message the planner sent a job (a plan or its revert), numbered per job, with the
    job's report on it. The newest row of a job is what the job must run now."""

    __tablename__ = "plan_deliveries"
    __table_args__ = (UniqueConstraint("job_id", "version"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    version: Mapped[int] = mapped_column(Integer)
    plan_id: Mapped[str] = mapped_column(ForeignKey("plans.id", ondelete="CASCADE"), index=True)
    action: Mapped[str] = mapped_column(String(16))
    message: Mapped[PlanMessage] = mapped_column(JsonDocument(PlanMessage))
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    outcome: Mapped[str | None] = mapped_column(String(16))
    cost_s: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)
    reporter: Mapped[str | None] = mapped_column(String(255))
    reported_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Escalation(Base):
    """The planner's ski-rental state of one incident (greyhound.core.escalation), kept so that
    a restarted planner goes on with the loss it had counted."""

    __tablename__ = "escalations"

    incident_id: Mapped[str] = mapped_column(ForeignKey("incidents.id", ondelete="CASCADE"),
                                             primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    state: Mapped[dict[str, Any]] = mapped_column(default=dict)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class Approval(Base):
    __tablename__ = "approvals"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    plan_id: Mapped[str] = mapped_column(ForeignKey("plans.id", ondelete="CASCADE"), index=True)
    decision: Mapped[str] = mapped_column(String(16))
    approver: Mapped[str] = mapped_column(String(255))
    comment: Mapped[str] = mapped_column(Text, default="")
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())

    plan: Mapped[Plan] = relationship(back_populates="approvals", lazy="raise")


class Webhook(Base):
    """An on-call endpoint. The signing secret is kept encrypted (``secret_enc``): unlike a token
    it must be recovered to sign each delivery, so a hash cannot stand in for it."""

    __tablename__ = "webhooks"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=_uuid)
    name: Mapped[str] = mapped_column(String(255), default="")
    url: Mapped[str] = mapped_column(Text)
    secret_enc: Mapped[str] = mapped_column(Text)
    events: Mapped[list[str]] = mapped_column(JSONB, default=list)  # event names; none: all
    format: Mapped[str] = mapped_column(String(16), default="json")
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    created_by: Mapped[str] = mapped_column(String(255), default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class WebhookDelivery(Base):
    """One event for one webhook: the body is frozen here so every retry sends the same bytes
    under the same idempotency key (``event_id``)."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (UniqueConstraint("webhook_id", "event_id"),
                      Index("ix_webhook_deliveries_due", "status", "next_attempt_at"))

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    webhook_id: Mapped[str] = mapped_column(ForeignKey("webhooks.id", ondelete="CASCADE"))
    event_id: Mapped[str] = mapped_column(String(64))
    event: Mapped[str] = mapped_column(String(64), default="")
    incident_id: Mapped[str | None] = mapped_column(ForeignKey("incidents.id", ondelete="SET NULL"))
    payload: Mapped[dict[str, Any]] = mapped_column(default=dict)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    last_error: Mapped[str | None] = mapped_column(Text)
    next_attempt_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    delivered_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class WebhookAttempt(Base):
    """Every HTTP attempt of a delivery, with what the receiver answered (or why none came)."""

    __tablename__ = "webhook_attempts"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    delivery_id: Mapped[int] = mapped_column(
        ForeignKey("webhook_deliveries.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now(),
                                         index=True)
    outcome: Mapped[str] = mapped_column(String(16))
    status_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    duration_ms: Mapped[float] = mapped_column(Float, default=0.0)


class ApiToken(Base):
    """A bearer token. Only a keyed hash of the secret is stored; ``prefix`` lets people tell
    their tokens apart in listings without the secret."""

    __tablename__ = "api_tokens"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=_uuid)
    name: Mapped[str] = mapped_column(String(255))
    role: Mapped[str] = mapped_column(String(16))
    # a job token's job: the only one whose own routes it may call (None for the other roles)
    job_id: Mapped[str | None] = mapped_column(String(128))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_by: Mapped[str] = mapped_column(String(255), default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class AuditEntry(Base):
    """Who changed what, when and why: every state-changing call of the API and the CLI."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now(),
                                         index=True)
    actor: Mapped[str] = mapped_column(String(255))
    token_id: Mapped[str | None] = mapped_column(String(32))
    action: Mapped[str] = mapped_column(String(64))
    target_type: Mapped[str] = mapped_column(String(32))
    target_id: Mapped[str] = mapped_column(String(128))
    note: Mapped[str] = mapped_column(Text, default="")
    detail: Mapped[dict[str, Any]] = mapped_column(default=dict)


class ProcessedEvent(Base):
    """Ledger of handled bus events: a redelivered event finds its id here and is skipped."""

    __tablename__ = "processed_events"

    event_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    consumer: Mapped[str] = mapped_column(String(64), primary_key=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now(),
                                         index=True)


class OutboxMessage(Base):
    """A bus message that a commit announces, written in the same transaction as the change.

    The process that committed publishes it at once; a relay publishes whatever is left (the
    process died, the bus was away) at start-up and periodically, in ``seq`` order, with the
    event id as Nats-Msg-Id so a second publish is stored once. ``sent_at`` set: published;
    ``failed_at`` set: the server refused it for good (too large, a bad subject), kept to read.
    """

    __tablename__ = "outbox"
    __table_args__ = (
        Index("ix_outbox_unsent", "seq", postgresql_where="sent_at IS NULL AND failed_at IS NULL"),
        Index("ix_outbox_sent_at", "sent_at"),
    )

    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    event_id: Mapped[str] = mapped_column(String(64), unique=True)
    subject: Mapped[str] = mapped_column(String(255))
    kind: Mapped[str] = mapped_column(String(64))  # the contract's message class
    incident_id: Mapped[str | None] = mapped_column(String(32), index=True)
    payload: Mapped[str] = mapped_column(Text)  # the message's JSON, published as is
    producer: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    sent_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    failed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    last_error: Mapped[str | None] = mapped_column(Text)


class ValidationClaim(Base):
    """One validator holds one suspicion: pausing a job is done once per suspicion, not once per
    delivery. ``running`` with a lease that its holder renews while it works; a lease that ran
    out means its holder died, and the validation may be tried again up to a bound; ``done``
    (recorded on the incident) and ``abandoned`` (out of tries) are final. The suspicion's JSON
    is kept so that a claim can be resumed without the bus."""

    __tablename__ = "validation_claims"

    suspicion_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    incident_id: Mapped[str] = mapped_column(ForeignKey("incidents.id", ondelete="CASCADE"),
                                             index=True)
    job_id: Mapped[str] = mapped_column(String(128))
    suspicion: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16), default="running")
    attempts: Mapped[int] = mapped_column(Integer, default=1)
    holder: Mapped[str] = mapped_column(String(64))
    lease_until: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class JobValidation(Base):
    """The one validation a job is under, across every validator: its holder (the validator and
    the suspicion it validates) pauses the job only while it holds this row, until
    ``lease_until``, which it renews while it works; released when the job is resumed. A holder
    that died leaves a row whose lease lapses (services.common.db.exclusion)."""

    __tablename__ = "job_validations"

    job_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    holder: Mapped[str] = mapped_column(String(64))
    suspicion_id: Mapped[str] = mapped_column(String(64))
    lease_until: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    taken_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
