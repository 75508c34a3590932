"""All SQL lives here. Functions take the caller's session and never commit: the session is a
unit of work's (services.common.unit_of_work: a request, one bus message), which commits once,
then sends what it staged, then the message is acked."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Select, and_, delete, exists, func, or_, select, text, tuple_, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import selectinload

from greyhound.core import lifecycle, plan_lifecycle
from services.common.bus.contract import JobLayout, PlanMessage
from services.common.db.documents import Culprit, Evidence, Note, PlanParams, Topology
from services.common.db.models import (
    OPEN_PLAN,
    ApiToken,
    Approval,
    AuditEntry,
    Escalation,
    Incident,
    IncidentEvent,
    Job,
    OutboxMessage,
    Plan,
    PlanDelivery,
    ProcessedEvent,
    Rank,
    ValidationClaim,
    Webhook,
    WebhookAttempt,
    WebhookDelivery,
)


async def ping(session: AsyncSession) -> None:
    """A round trip to the database (health checks)."""
    await session.execute(text("select 1"))


async def writable(session: AsyncSession) -> bool:
    """Whether the database takes writes now: up, and not a standby (a failover may leave a
    connection on one, read-only)."""
    return bool(await session.scalar(text(
        "SELECT NOT pg_is_in_recovery() AND current_setting('transaction_read_only') = 'off'")))


async def try_lock(session: AsyncSession, key: int) -> bool:
    """Take the transaction-scoped advisory lock ``key`` unless another transaction holds it."""
    return bool(await session.scalar(text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": key}))


async def try_lock_name(session: AsyncSession, name: str) -> bool:
    """``try_lock`` on a key made from ``name`` (a subject, say)."""
    return bool(await session.scalar(text("SELECT pg_try_advisory_xact_lock(hashtextextended("
                                          ":n, 0))"), {"n": name}))


async def claim_event(session: AsyncSession, consumer: str, event_id: str) -> bool:
    """Record that ``consumer`` handles ``event_id``; False when it was handled before."""
    stmt = (insert(ProcessedEvent).values(event_id=event_id, consumer=consumer)
            .on_conflict_do_nothing().returning(ProcessedEvent.event_id))
    return (await session.execute(stmt)).first() is not None


async def touch_job(session: AsyncSession, job_id: str, *, world_size: int | None = None,
                    topology: Topology | None = None) -> None:
    values: dict[str, Any] = {"id": job_id, "last_seen_at": func.now()}
    update: dict[str, Any] = {"last_seen_at": func.now()}
    if world_size is not None:
        values["world_size"] = update["world_size"] = world_size
    if topology is not None:
        values["topology"] = update["topology"] = topology
    else:
        values["topology"] = Topology()
    await session.execute(insert(Job).values(**values)
                          .on_conflict_do_update(index_elements=[Job.id], set_=update))


async def upsert_ranks(session: AsyncSession, job_id: str, agent_id: str,
                       ranks: Sequence[dict[str, Any]]) -> None:
    if not ranks:
        return
    rows = [{"job_id": job_id, "agent_id": agent_id, **r} for r in ranks]
    stmt = insert(Rank).values(rows)
    await session.execute(stmt.on_conflict_do_update(
        index_elements=[Rank.job_id, Rank.rank],
        set_={"host": stmt.excluded.host, "node": stmt.excluded.node,
              "device": stmt.excluded.device, "pid": stmt.excluded.pid,
              "agent_id": stmt.excluded.agent_id, "marks_off": stmt.excluded.marks_off,
              "last_seen_at": func.now()}))


async def ranks_held_by_others(session: AsyncSession, job_id: str, agent_id: str,
                               ranks: Sequence[int], *, seen_since: datetime
                               ) -> Sequence[tuple[int, str]]:
    """(rank, agent) of ``ranks`` of the job that another agent announced since ``seen_since``:
    ranks a hello from ``agent_id`` may not take."""
    if not ranks:
        return []
    rows = await session.execute(
        select(Rank.rank, Rank.agent_id).where(
            Rank.job_id == job_id, Rank.rank.in_(list(ranks)), Rank.agent_id != agent_id,
            Rank.last_seen_at >= seen_since).order_by(Rank.rank))
    return [(int(r), str(a)) for r, a in rows.all()]


async def list_jobs(session: AsyncSession) -> Sequence[Job]:
    return (await session.scalars(select(Job).order_by(Job.last_seen_at.desc()))).all()


async def get_job(session: AsyncSession, job_id: str) -> Job | None:
    return await session.scalar(
        select(Job).where(Job.id == job_id).options(selectinload(Job.ranks)))


async def find_open_incident(session: AsyncSession, job_id: str, dedup_key: str) -> Incident | None:
    return await session.scalar(
        select(Incident).where(Incident.job_id == job_id, Incident.dedup_key == dedup_key,
                               Incident.status != "resolved").with_for_update())


async def open_incidents(session: AsyncSession, job_id: str,
                         dedup_prefix: str) -> Sequence[Incident]:
    """A job's open incidents whose dedup key starts with ``dedup_prefix``, oldest first (a slow
    job can hold several: a second fault while the first is open is its own incident)."""
    return (await session.scalars(
        select(Incident).where(Incident.job_id == job_id,
                               Incident.dedup_key.startswith(dedup_prefix, autoescape=True),
                               Incident.status != "resolved")
        .order_by(Incident.opened_at, Incident.id).with_for_update())).all()


@dataclass(frozen=True, slots=True)
class Moment:
    """When a slowdown reached a stage, by the wall clock and by the job's iterations."""

    at: datetime
    iteration: int


async def open_incident(session: AsyncSession, *, job_id: str, kind: str, dedup_key: str,
                        severity: float, summary: str, culprit: Culprit, evidence: Evidence,
                        stage_detail: Note, suspected: Moment | None = None,
                        confirmed: Moment | None = None) -> Incident:
    """A new incident; a slowdown's says when it was suspected and, if it is already, when it
    was confirmed (greyhound.core.levels)."""
    incident = Incident(job_id=job_id, kind=kind, dedup_key=dedup_key, severity=severity,
                        summary=summary, culprit=culprit, evidence=evidence, status=lifecycle.OPENED)
    if suspected is not None:
        incident.suspected_at, incident.suspected_iteration = suspected.at, suspected.iteration
    if confirmed is not None:
        confirm_incident(incident, confirmed)
    session.add(incident)
    await session.flush()
    await add_timeline(session, incident, lifecycle.OPENED, stage_detail)
    return incident


def confirm_incident(incident: Incident, confirmed: Moment) -> None:
    """The incident's slowdown held: it may now be validated."""
    incident.confirmed_at, incident.confirmed_iteration = confirmed.at, confirmed.iteration


async def add_timeline(session: AsyncSession, incident: Incident, stage: str,
                       detail: Note) -> lifecycle.Status:
    """Record one stage and move the status as the lifecycle says (greyhound.core.lifecycle);
    raises IllegalTransition, before anything is added, for an entry the status does not allow.
    Returns the new status."""
    status = lifecycle.advance(incident.status, stage)
    session.add(IncidentEvent(incident_id=incident.id, stage=stage, detail=detail))
    now = datetime.now(UTC)
    incident.updated_at = now
    if status == "resolved" and incident.status != "resolved":
        incident.resolved_at = now
    incident.status = status
    return status


def _incident_filter(q: Select[Any], *, job_id: str | None, status: str | None,
                     kind: str | None, opened_after: datetime | None = None,
                     opened_before: datetime | None = None) -> Select[Any]:
    """``status`` is a stage, or ``open`` for every incident not resolved yet; ``kind`` ending
    in ``*`` is a prefix (``hang*`` matches every hang diagnosis)."""
    if job_id is not None:
        q = q.where(Incident.job_id == job_id)
    if status == "open":
        q = q.where(Incident.status != "resolved")
    elif status is not None:
        q = q.where(Incident.status == status)
    if kind is not None and kind.endswith("*"):
        q = q.where(Incident.kind.startswith(kind[:-1], autoescape=True))
    elif kind is not None:
        q = q.where(Incident.kind == kind)
    if opened_after is not None:
        q = q.where(Incident.opened_at >= opened_after)
    if opened_before is not None:
        q = q.where(Incident.opened_at < opened_before)
    return q


async def list_incidents(session: AsyncSession, *, job_id: str | None = None,
                         status: str | None = None, kind: str | None = None,
                         limit: int = 100, offset: int = 0,
                         opened_after: datetime | None = None,
                         opened_before: datetime | None = None) -> Sequence[Incident]:
    q = _incident_filter(select(Incident).options(selectinload(Incident.timeline)),
                         job_id=job_id, status=status, kind=kind, opened_after=opened_after,
                         opened_before=opened_before)
    q = q.order_by(Incident.opened_at.desc(), Incident.id).limit(limit).offset(offset)
    return (await session.scalars(q)).all()


async def count_incidents(session: AsyncSession, *, job_id: str | None = None,
                          status: str | None = None, kind: str | None = None,
                          opened_after: datetime | None = None,
                          opened_before: datetime | None = None) -> int:
    q = _incident_filter(select(func.count()).select_from(Incident), job_id=job_id,
                         status=status, kind=kind, opened_after=opened_after,
                         opened_before=opened_before)
    return int((await session.execute(q)).scalar_one())


async def get_incident(session: AsyncSession, incident_id: str) -> Incident | None:
    return await session.scalar(select(Incident).where(Incident.id == incident_id)
                                .options(selectinload(Incident.timeline)))


async def job_ranks(session: AsyncSession, job_id: str) -> Sequence[Rank]:
    """Every known rank of a job (which agent serves it, on which host and device)."""
    return (await session.scalars(select(Rank).where(Rank.job_id == job_id)
                                  .order_by(Rank.rank))).all()


async def get_incident_for_update(session: AsyncSession, incident_id: str, *,
                                  timeline: bool = False) -> Incident | None:
    """The incident, its row locked until the transaction ends, so that whoever locks it next
    sees what this transaction did with it; with its timeline loaded when asked."""
    stmt = select(Incident).where(Incident.id == incident_id).with_for_update()
    if timeline:
        stmt = stmt.options(selectinload(Incident.timeline))
    return await session.scalar(stmt)


# ---- jobs, as the REST API pages them ---------------------------------------------------------

async def list_jobs_page(session: AsyncSession, *, limit: int, offset: int) -> Sequence[Job]:
    return (await session.scalars(select(Job).order_by(Job.last_seen_at.desc(), Job.id)
                                  .limit(limit).offset(offset))).all()


async def count_jobs(session: AsyncSession) -> int:
    return int((await session.execute(select(func.count()).select_from(Job))).scalar_one())


async def open_incidents_of(session: AsyncSession, job_ids: Sequence[str]) -> Sequence[Incident]:
    """The open incidents of these jobs (what their live state is made of)."""
    if not job_ids:
        return []
    return (await session.scalars(
        select(Incident).where(Incident.job_id.in_(job_ids), Incident.status != "resolved")
        .order_by(Incident.opened_at))).all()


async def rank_counts(session: AsyncSession, job_ids: Sequence[str]) -> dict[str, int]:
    if not job_ids:
        return {}
    rows = await session.execute(select(Rank.job_id, func.count()).where(Rank.job_id.in_(job_ids))
                                 .group_by(Rank.job_id))
    return {job: int(n) for job, n in rows.all()}


# ---- plans and approvals ----------------------------------------------------------------------

async def list_plans(session: AsyncSession, *, job_id: str | None = None,
                     incident_id: str | None = None, status: str | None = None,
                     limit: int = 100, offset: int = 0) -> Sequence[Plan]:
    q = select(Plan).options(selectinload(Plan.approvals))
    if job_id is not None:
        q = q.where(Plan.job_id == job_id)
    if incident_id is not None:
        q = q.where(Plan.incident_id == incident_id)
    if status is not None:
        q = q.where(Plan.status == status)
    q = q.order_by(Plan.created_at.desc(), Plan.id).limit(limit).offset(offset)
    return (await session.scalars(q)).all()


async def get_plan(session: AsyncSession, plan_id: str, *, for_update: bool = False) -> Plan | None:
    q = select(Plan).where(Plan.id == plan_id).options(selectinload(Plan.approvals))
    if for_update:
        q = q.with_for_update()
    return await session.scalar(q)


async def decide_plan(session: AsyncSession, plan: Plan, *, decision: str, approver: str,
                      comment: str) -> Approval:
    """Record an approval or a rejection (an operator's, or ``policy`` for an automatic plan);
    raises IllegalPlanTransition when the plan does not await one."""
    move_plan(plan, "approve" if decision == "approve" else "reject")
    approval = Approval(plan_id=plan.id, decision=decision, approver=approver, comment=comment)
    session.add(approval)
    await session.flush()
    return approval


def move_plan(plan: Plan, action: str, *, reason: str | None = None,
              now: datetime | None = None) -> plan_lifecycle.PlanStatus:
    """Move the plan as greyhound.core.plan_lifecycle says (raises IllegalPlanTransition), with
    the timestamp that goes with the new status."""
    status = plan_lifecycle.advance(plan.status, action)
    at = now or datetime.now(UTC)
    if status == "applied":
        plan.applied_at = at
    elif status == "reverted":
        plan.reverted_at = at
    plan.status = status
    if reason is not None:
        plan.reason = reason[:2000]
    return status


async def create_plan(session: AsyncSession, *, incident_id: str, job_id: str, strategy: str,
                      params: PlanParams, policy: str, expected_gain: float | None,
                      expires_at: datetime | None, reason: str = "") -> Plan | None:
    """A proposed plan; None when the incident has an open plan of this strategy already
    (another planner proposed it: the index ``uq_plans_open_strategy`` admits one, and a
    proposal racing it waits for its commit, then inserts nothing)."""
    new = (insert(Plan)
           .values(id=uuid.uuid4().hex, incident_id=incident_id, job_id=job_id,
                   strategy=strategy, params=params, params_version=1,
                   status=plan_lifecycle.PROPOSED, policy=policy, expected_gain=expected_gain,
                   expires_at=expires_at, reason=reason)
           .on_conflict_do_nothing(index_elements=[Plan.incident_id, Plan.strategy],
                                   index_where=text(OPEN_PLAN))
           .returning(Plan.id))
    plan_id = await session.scalar(new)
    return None if plan_id is None else await get_plan(session, plan_id)


async def plans_by_id(session: AsyncSession, plan_ids: Sequence[str], *,
                      for_update: bool = False) -> dict[str, Plan]:
    if not plan_ids:
        return {}
    q = select(Plan).where(Plan.id.in_(plan_ids)).options(selectinload(Plan.approvals))
    if for_update:
        q = q.with_for_update(of=Plan)
    return {p.id: p for p in await session.scalars(q)}


async def plans_of_incidents(session: AsyncSession, incident_ids: Sequence[str]) -> Sequence[Plan]:
    """Every plan of these incidents, oldest first."""
    if not incident_ids:
        return []
    return (await session.scalars(select(Plan).where(Plan.incident_id.in_(incident_ids))
                                  .order_by(Plan.created_at, Plan.id))).all()


JobFilter = Callable[[str], bool]


async def _of_jobs(session: AsyncSession, job_id: Any, where: Sequence[Any],
                   jobs: JobFilter | None) -> list[Any] | None:
    """``where`` narrowed to the jobs ``jobs`` accepts (all of ``where`` when ``jobs`` is
    None; None when none of the jobs it matches is accepted), from the distinct jobs that
    ``where`` matches. A partitioned service's query filters its jobs here, before its limit
    and its row locks: filtered after them, a backlog of other partitions' rows would fill its
    limit, and its SKIP LOCKED locks would hide those rows from their own partition's
    process."""
    if jobs is None:
        return list(where)
    ids = [j for j in (await session.scalars(select(job_id).where(*where).distinct())).all()
           if jobs(j)]
    return [*where, job_id.in_(ids)] if ids else None


async def approved_undelivered(session: AsyncSession, strategies: Sequence[str],
                               limit: int = 100, *, jobs: JobFilter | None = None
                               ) -> Sequence[Plan]:
    """Approved plans no delivery carries yet (an operator approved them since) of the jobs
    ``jobs`` accepts, locked for this caller (SKIP LOCKED: several planners share the work)."""
    where = await _of_jobs(session, Plan.job_id, (
        Plan.status == "approved", Plan.version.is_(None), Plan.strategy.in_(strategies)), jobs)
    if where is None:
        return []
    return (await session.scalars(
        select(Plan).where(*where)
        .order_by(Plan.created_at).limit(limit).with_for_update(skip_locked=True))).all()


async def due_proposals(session: AsyncSession, now: datetime, limit: int = 100, *,
                        jobs: JobFilter | None = None) -> Sequence[Plan]:
    """Proposed plans (of the jobs ``jobs`` accepts) whose decision time has run out, locked
    for this caller."""
    where = await _of_jobs(session, Plan.job_id,
                           (Plan.status == "proposed", Plan.expires_at <= now), jobs)
    if where is None:
        return []
    return (await session.scalars(
        select(Plan).where(*where)
        .order_by(Plan.expires_at).limit(limit).with_for_update(skip_locked=True))).all()


async def learned_costs(session: AsyncSession, job_id: str) -> Sequence[tuple[str, float]]:
    """(strategy, cost_s) of every plan the job applied and reported a cost for, in the order it
    applied them: the observations the escalation's overhead estimates learn from."""
    rows = await session.execute(
        select(Plan.strategy, Plan.cost_s).where(Plan.job_id == job_id, Plan.cost_s.is_not(None),
                                                 Plan.applied_at.is_not(None))
        .order_by(Plan.applied_at, Plan.id))
    return [(str(st), float(c)) for st, c in rows.all() if c is not None]


# ---- deliveries: what each job must run -------------------------------------------------------

async def lock_job(session: AsyncSession, job_id: str) -> Job | None:
    """The job's row, locked: deliveries of one job are numbered one after the other."""
    return await session.scalar(select(Job).where(Job.id == job_id).with_for_update())


async def current_delivery(session: AsyncSession, job_id: str) -> PlanDelivery | None:
    """The newest delivery of the job: what it must run now (None: its own layout)."""
    return await session.scalar(select(PlanDelivery).where(PlanDelivery.job_id == job_id)
                                .order_by(PlanDelivery.version.desc()).limit(1))


async def get_delivery(session: AsyncSession, job_id: str, version: int, *,
                       for_update: bool = False) -> PlanDelivery | None:
    q = select(PlanDelivery).where(PlanDelivery.job_id == job_id, PlanDelivery.version == version)
    if for_update:
        q = q.with_for_update()
    return await session.scalar(q)


async def add_delivery(session: AsyncSession, *, job_id: str, version: int, plan_id: str,
                       action: str, message: PlanMessage) -> PlanDelivery:
    row = PlanDelivery(job_id=job_id, version=version, plan_id=plan_id, action=action,
                       message=message)
    session.add(row)
    await session.flush()
    return row


async def set_job_layout(session: AsyncSession, job_id: str, layout: JobLayout) -> Job:
    """Record the parallel layout a job declared (kept in its topology under ``layout``)."""
    await touch_job(session, job_id)
    job = await lock_job(session, job_id)
    assert job is not None
    job.topology = job.topology.model_copy(update={"layout": layout})
    await session.flush()
    return job


async def job_layout(session: AsyncSession, job_id: str) -> JobLayout | None:
    topology = await session.scalar(select(Job.topology).where(Job.id == job_id))
    return None if topology is None else topology.layout


# ---- the planner's escalation state -----------------------------------------------------------

async def save_escalation(session: AsyncSession, incident_id: str, job_id: str,
                          state: dict[str, Any]) -> None:
    stmt = insert(Escalation).values(incident_id=incident_id, job_id=job_id, state=state,
                                     updated_at=func.now())
    await session.execute(stmt.on_conflict_do_update(
        index_elements=[Escalation.incident_id],
        set_={"state": stmt.excluded.state, "updated_at": func.now()}))


async def open_escalations(session: AsyncSession) -> Sequence[tuple[Escalation, Incident]]:
    """Escalation states whose incident is open or still has a plan in force."""
    in_force = select(Plan.incident_id).where(Plan.status.in_(("proposed", "approved", "applied")))
    rows = await session.execute(
        select(Escalation, Incident).join(Incident, Incident.id == Escalation.incident_id)
        .where(or_(Incident.status != "resolved", Incident.id.in_(in_force))))
    return [(e, i) for e, i in rows.all()]


# ---- API tokens -------------------------------------------------------------------------------

async def create_token(session: AsyncSession, *, name: str, role: str, token_hash: str,
                       prefix: str, created_by: str, expires_at: datetime | None,
                       job_id: str | None = None) -> ApiToken:
    token = ApiToken(name=name, role=role, token_hash=token_hash, prefix=prefix,
                     created_by=created_by, expires_at=expires_at, job_id=job_id)
    session.add(token)
    await session.flush()
    return token


async def token_by_hash(session: AsyncSession, token_hash: str) -> ApiToken | None:
    return await session.scalar(select(ApiToken).where(ApiToken.token_hash == token_hash))


async def list_tokens(session: AsyncSession, *, include_revoked: bool = False) -> Sequence[ApiToken]:
    q = select(ApiToken).order_by(ApiToken.created_at, ApiToken.id)
    if not include_revoked:
        q = q.where(ApiToken.revoked_at.is_(None))
    return (await session.scalars(q)).all()


async def find_tokens(session: AsyncSession, id_or_name: str) -> Sequence[ApiToken]:
    """Tokens whose id, id prefix (8+ characters) or name is ``id_or_name``."""
    conds = [ApiToken.id == id_or_name, ApiToken.name == id_or_name]
    if len(id_or_name) >= 8:
        conds.append(ApiToken.id.startswith(id_or_name, autoescape=True))
    return (await session.scalars(select(ApiToken).where(or_(*conds)))).all()


async def get_token(session: AsyncSession, token_id: str) -> ApiToken | None:
    return await session.get(ApiToken, token_id)


async def mark_token_used(session: AsyncSession, token_id: str, at: datetime) -> None:
    await session.execute(update(ApiToken).where(ApiToken.id == token_id)
                          .values(last_used_at=at))


# ---- the audit log ----------------------------------------------------------------------------

async def audit(session: AsyncSession, *, actor: str, token_id: str | None, action: str,
                target_type: str, target_id: str, note: str = "",
                detail: dict[str, Any] | None = None) -> None:
    session.add(AuditEntry(actor=actor, token_id=token_id, action=action, target_type=target_type,
                           target_id=target_id, note=note, detail=detail or {}))


async def list_audit(session: AsyncSession, *, limit: int = 100, offset: int = 0,
                     target_type: str | None = None,
                     target_id: str | None = None) -> Sequence[AuditEntry]:
    q = select(AuditEntry)
    if target_type is not None:
        q = q.where(AuditEntry.target_type == target_type)
    if target_id is not None:
        q = q.where(AuditEntry.target_id == target_id)
    return (await session.scalars(q.order_by(AuditEntry.at.desc(), AuditEntry.id.desc())
                                  .limit(limit).offset(offset))).all()


async def incident_audit(session: AsyncSession, incident_id: str, plan_ids: Sequence[str], *,
                         limit: int = 200) -> Sequence[AuditEntry]:
    """What was done to an incident and to its plans (decisions, the job's reports), newest
    first."""
    about = or_(and_(AuditEntry.target_type == "incident", AuditEntry.target_id == incident_id),
                and_(AuditEntry.target_type == "plan", AuditEntry.target_id.in_(plan_ids)))
    return (await session.scalars(select(AuditEntry).where(about)
                                  .order_by(AuditEntry.at.desc(), AuditEntry.id.desc())
                                  .limit(limit))).all()


# ---- webhooks and deliveries ------------------------------------------------------------------

async def create_webhook(session: AsyncSession, *, name: str, url: str, secret_enc: str,
                         events: list[str], format: str, created_by: str) -> Webhook:
    hook = Webhook(name=name, url=url, secret_enc=secret_enc, events=events, format=format,
                   created_by=created_by, enabled=True)
    session.add(hook)
    await session.flush()
    return hook


async def list_webhooks(session: AsyncSession, *, enabled_only: bool = False) -> Sequence[Webhook]:
    q = select(Webhook).order_by(Webhook.created_at, Webhook.id)
    if enabled_only:
        q = q.where(Webhook.enabled.is_(True))
    return (await session.scalars(q)).all()


async def get_webhook(session: AsyncSession, webhook_id: str) -> Webhook | None:
    return await session.get(Webhook, webhook_id)


async def delete_webhook(session: AsyncSession, webhook_id: str) -> bool:
    res = await session.execute(delete(Webhook).where(Webhook.id == webhook_id)
                                .returning(Webhook.id))
    return res.first() is not None


async def count_webhooks(session: AsyncSession) -> int:
    return int((await session.execute(select(func.count()).select_from(Webhook)
                                       .where(Webhook.enabled.is_(True)))).scalar_one())


async def enqueue_delivery(session: AsyncSession, *, webhook_id: str, event_id: str, event: str,
                           incident_id: str | None, payload: dict[str, Any],
                           due: datetime | None) -> int | None:
    """A pending delivery, or with no ``due`` time one ``held`` until its incident pages
    (release_held_deliveries); None when this webhook already has one for this idempotency
    key."""
    stmt = (insert(WebhookDelivery)
            .values(webhook_id=webhook_id, event_id=event_id, event=event,
                    incident_id=incident_id, payload=payload,
                    status="pending" if due is not None else "held", attempts=0,
                    next_attempt_at=due)
            .on_conflict_do_nothing().returning(WebhookDelivery.id))
    row = (await session.execute(stmt)).first()
    return None if row is None else int(row[0])


async def release_held_deliveries(session: AsyncSession, incident_id: str,
                                  due: datetime) -> int:
    """The incident's held deliveries become due at ``due``; how many."""
    res = await session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.incident_id == incident_id, WebhookDelivery.status == "held")
        .values(status="pending", next_attempt_at=due).returning(WebhookDelivery.id))
    return len(res.all())


async def withdraw_held_deliveries(session: AsyncSession, incident_id: str) -> int:
    """The incident's held deliveries will never be sent (its suspicion was withdrawn); how
    many. They stay listed, as ``withdrawn``."""
    res = await session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.incident_id == incident_id, WebhookDelivery.status == "held")
        .values(status="withdrawn", last_error="the suspicion was withdrawn before it held")
        .returning(WebhookDelivery.id))
    return len(res.all())


async def claim_due_deliveries(session: AsyncSession, now: datetime, lease_until: datetime,
                               limit: int) -> Sequence[WebhookDelivery]:
    """Deliveries due now, leased to this caller until ``lease_until`` (SKIP LOCKED, so several
    notifiers share the work): one that is not finished by then (its sender died) is due again.

    The lease is the row's ``next_attempt_at`` while it is ``sending``, and that value is the
    holder's token (record_leased_attempt writes only under it): a row is claimed only once its
    lease has ended (``next_attempt_at <= now``) and the new lease ends after ``now``, so each
    claim of a row leaves a value that no earlier claim of it held."""
    rows = (await session.scalars(
        select(WebhookDelivery)
        .where(WebhookDelivery.status.in_(("pending", "sending")),
               WebhookDelivery.next_attempt_at <= now)
        .order_by(WebhookDelivery.next_attempt_at, WebhookDelivery.id)
        .limit(limit).with_for_update(skip_locked=True))).all()
    for row in rows:
        row.status = "sending"
        row.next_attempt_at = lease_until
    return rows


def _after_attempt(error: str | None, final_status: str, next_attempt_at: datetime | None,
                   at: datetime) -> dict[str, Any]:
    values: dict[str, Any] = {"status": final_status, "attempts": WebhookDelivery.attempts + 1,
                              "last_error": error, "next_attempt_at": next_attempt_at}
    if final_status == "delivered":
        values["delivered_at"] = at
    return values


async def record_attempt(session: AsyncSession, delivery_id: int, *, outcome: str,
                         status_code: int | None, error: str | None, duration_ms: float,
                         final_status: str, next_attempt_at: datetime | None,
                         at: datetime) -> None:
    """One attempt of a delivery nobody else can see yet (the API's test delivery, made and
    sent in one transaction), and where the delivery stands after it."""
    session.add(WebhookAttempt(delivery_id=delivery_id, outcome=outcome, status_code=status_code,
                               error=error, duration_ms=duration_ms, at=at))
    await session.execute(update(WebhookDelivery).where(WebhookDelivery.id == delivery_id)
                          .values(**_after_attempt(error, final_status, next_attempt_at, at)))


async def record_leased_attempt(session: AsyncSession, delivery_id: int, *,
                                lease_until: datetime, outcome: str, status_code: int | None,
                                error: str | None, duration_ms: float, final_status: str,
                                next_attempt_at: datetime | None, at: datetime) -> bool:
    """A notifier's attempt of a delivery it claimed with the lease ``lease_until``
    (claim_due_deliveries), written only while that lease is still the delivery's: False, and
    nothing written, when another notifier has claimed the delivery since, so a late writer
    cannot turn the new holder's "delivered" back into "pending" (nor log an attempt the
    delivery's count would not include)."""
    held = (await session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.id == delivery_id, WebhookDelivery.status == "sending",
               WebhookDelivery.next_attempt_at == lease_until)
        .values(**_after_attempt(error, final_status, next_attempt_at, at))
        .returning(WebhookDelivery.id))).first()
    if held is None:
        return False
    session.add(WebhookAttempt(delivery_id=delivery_id, outcome=outcome, status_code=status_code,
                               error=error, duration_ms=duration_ms, at=at))
    return True


async def list_deliveries(session: AsyncSession, webhook_id: str, *, limit: int = 50,
                          offset: int = 0) -> Sequence[WebhookDelivery]:
    return (await session.scalars(
        select(WebhookDelivery).where(WebhookDelivery.webhook_id == webhook_id)
        .order_by(WebhookDelivery.id.desc()).limit(limit).offset(offset))).all()


async def delivery_attempts(session: AsyncSession,
                            delivery_ids: Sequence[int]) -> Sequence[WebhookAttempt]:
    if not delivery_ids:
        return []
    return (await session.scalars(
        select(WebhookAttempt).where(WebhookAttempt.delivery_id.in_(delivery_ids))
        .order_by(WebhookAttempt.id))).all()


# ---- what /metrics and the fleet view read ----------------------------------------------------

async def incident_counts(session: AsyncSession) -> list[tuple[str, str, int]]:
    rows = await session.execute(select(Incident.kind, Incident.status, func.count())
                                 .group_by(Incident.kind, Incident.status))
    return [(k, s, int(n)) for k, s, n in rows.all()]


async def attempt_outcomes(session: AsyncSession) -> list[tuple[str, int]]:
    rows = await session.execute(select(WebhookAttempt.outcome, func.count())
                                 .group_by(WebhookAttempt.outcome))
    return [(o, int(n)) for o, n in rows.all()]


async def delivery_states(session: AsyncSession) -> list[tuple[str, int]]:
    rows = await session.execute(select(WebhookDelivery.status, func.count())
                                 .group_by(WebhookDelivery.status))
    return [(s, int(n)) for s, n in rows.all()]


async def incidents_since(session: AsyncSession, since: datetime, *,
                          limit: int = 10_000) -> Sequence[Incident]:
    """Incidents opened since ``since`` or still open, with their timelines (newest first)."""
    return (await session.scalars(
        select(Incident).where(or_(Incident.opened_at >= since, Incident.status != "resolved"))
        .options(selectinload(Incident.timeline))
        .order_by(Incident.opened_at.desc()).limit(limit))).all()


async def jobs_by_id(session: AsyncSession, job_ids: Sequence[str]) -> dict[str, Job]:
    if not job_ids:
        return {}
    rows = await session.scalars(select(Job).where(Job.id.in_(job_ids)))
    return {j.id: j for j in rows}


async def ranks_of_jobs(session: AsyncSession, job_ids: Sequence[str]) -> Sequence[Rank]:
    if not job_ids:
        return []
    return (await session.scalars(select(Rank).where(Rank.job_id.in_(job_ids)))).all()


# ---- the outbox -------------------------------------------------------------------------------

async def stage_message(session: AsyncSession, *, event_id: str, subject: str, kind: str,
                        payload: str, producer: str, incident_id: str | None) -> bool:
    """Queue a message in the caller's transaction; False when this event id is queued already
    (a handler run again after a crash makes the same message with the same id)."""
    stmt = (insert(OutboxMessage)
            .values(event_id=event_id, subject=subject, kind=kind, payload=payload,
                    producer=producer, incident_id=incident_id, attempts=0)
            .on_conflict_do_nothing(index_elements=[OutboxMessage.event_id])
            .returning(OutboxMessage.seq))
    return (await session.execute(stmt)).first() is not None


async def claim_unsent(session: AsyncSession, *, limit: int, event_ids: Sequence[str] | None = None,
                       created_before: datetime | None = None,
                       producer: str | None = None) -> Sequence[OutboxMessage]:
    """Unsent messages in the order they were committed, locked for this caller (SKIP LOCKED:
    another relay takes the others): the given ids, or everything older than
    ``created_before``; with ``producer``, only that service's (on an authenticated bus a
    service may publish only its own subjects, so another's row would stall its relay)."""
    q = select(OutboxMessage).where(OutboxMessage.sent_at.is_(None),
                                    OutboxMessage.failed_at.is_(None))
    if producer is not None:
        q = q.where(OutboxMessage.producer == producer)
    if event_ids is not None:
        q = q.where(OutboxMessage.event_id.in_(list(event_ids)))
    if created_before is not None:
        q = q.where(OutboxMessage.created_at < created_before)
    return (await session.scalars(q.order_by(OutboxMessage.seq).limit(limit)
                                  .with_for_update(skip_locked=True))).all()


async def sent_later(session: AsyncSession, subject: str, seq: int) -> bool:
    """Whether a message on ``subject`` later than ``seq`` was sent already."""
    return bool(await session.scalar(select(exists().where(
        OutboxMessage.subject == subject, OutboxMessage.seq > seq,
        OutboxMessage.sent_at.is_not(None)))))


async def unsent_ids(session: AsyncSession, producer: str, *, limit: int) -> Sequence[str]:
    """The event ids of ``producer``'s unsent messages, oldest first."""
    return (await session.scalars(
        select(OutboxMessage.event_id).where(
            OutboxMessage.producer == producer, OutboxMessage.sent_at.is_(None),
            OutboxMessage.failed_at.is_(None))
        .order_by(OutboxMessage.seq).limit(limit))).all()


async def mark_sent(session: AsyncSession, seqs: Sequence[int], at: datetime) -> None:
    if seqs:
        await session.execute(update(OutboxMessage).where(OutboxMessage.seq.in_(list(seqs)))
                              .values(sent_at=at, attempts=OutboxMessage.attempts + 1))


async def mark_unsent(session: AsyncSession, seq: int, error: str, *, final: bool,
                      at: datetime) -> None:
    """A failed publish: counted, with why; ``final`` when no retry can succeed."""
    await session.execute(update(OutboxMessage).where(OutboxMessage.seq == seq).values(
        attempts=OutboxMessage.attempts + 1, last_error=error[:2000],
        failed_at=at if final else None))


async def outbox_backlog(session: AsyncSession) -> int:
    """Messages committed and not yet sent (nor refused for good)."""
    return int((await session.execute(
        select(func.count()).select_from(OutboxMessage)
        .where(OutboxMessage.sent_at.is_(None), OutboxMessage.failed_at.is_(None)))).scalar_one())


# ---- validation claims ------------------------------------------------------------------------

ClaimOutcome = tuple[str, int]  # ("mine" | "busy" | "done" | "abandoned" | "exhausted", attempts)


async def claim_validation(session: AsyncSession, *, suspicion_id: str, incident_id: str,
                           job_id: str, suspicion: str, holder: str, now: datetime,
                           lease_until: datetime, max_attempts: int) -> ClaimOutcome:
    """Take the validation of one suspicion, or say why not.

    ``mine``: new, or its last holder's lease ran out and tries are left (``attempts`` is this
    try's number); ``busy``: a live holder has it; ``done``/``abandoned``: finished; ``exhausted``:
    the lease ran out on the last allowed try (the caller records it abandoned)."""
    new = (insert(ValidationClaim)
           .values(suspicion_id=suspicion_id, incident_id=incident_id, job_id=job_id,
                   suspicion=suspicion, state="running", attempts=1, holder=holder,
                   lease_until=lease_until)
           .on_conflict_do_nothing(index_elements=[ValidationClaim.suspicion_id])
           .returning(ValidationClaim.suspicion_id))
    if (await session.execute(new)).first() is not None:
        return "mine", 1
    claim = await session.scalar(select(ValidationClaim)
                                 .where(ValidationClaim.suspicion_id == suspicion_id)
                                 .with_for_update())
    if claim is None:  # deleted between the two statements (retention): take it next time
        return "busy", 0
    if claim.state != "running":
        return claim.state, claim.attempts
    if claim.lease_until > now:
        return "busy", claim.attempts
    if claim.attempts >= max_attempts:
        return "exhausted", claim.attempts
    claim.attempts += 1
    claim.holder = holder
    claim.lease_until = lease_until
    return "mine", claim.attempts


async def renew_claim(session: AsyncSession, suspicion_id: str, holder: str,
                      lease_until: datetime) -> bool:
    """Extend a running claim's lease; False when this holder no longer has it."""
    res = await session.execute(
        update(ValidationClaim)
        .where(ValidationClaim.suspicion_id == suspicion_id, ValidationClaim.holder == holder,
               ValidationClaim.state == "running")
        .values(lease_until=lease_until).returning(ValidationClaim.suspicion_id))
    return res.first() is not None


async def finish_claim(session: AsyncSession, suspicion_id: str, state: str, at: datetime) -> None:
    await session.execute(update(ValidationClaim)
                          .where(ValidationClaim.suspicion_id == suspicion_id)
                          .values(state=state, finished_at=at))


async def finish_claim_held(session: AsyncSession, suspicion_id: str, holder: str,
                            at: datetime) -> bool:
    """Mark a running claim done if ``holder`` still holds it; False when another validator
    took it over (then this holder's result must not be recorded: the other one's will be)."""
    res = await session.execute(
        update(ValidationClaim)
        .where(ValidationClaim.suspicion_id == suspicion_id, ValidationClaim.holder == holder,
               ValidationClaim.state == "running")
        .values(state="done", finished_at=at).returning(ValidationClaim.suspicion_id))
    return res.first() is not None


async def lapsed_claims(session: AsyncSession, now: datetime,
                        limit: int = 100) -> Sequence[ValidationClaim]:
    """Running claims whose holder stopped renewing them (it died mid-validation)."""
    return (await session.scalars(
        select(ValidationClaim).where(ValidationClaim.state == "running",
                                      ValidationClaim.lease_until < now)
        .order_by(ValidationClaim.created_at).limit(limit))).all()


async def unclaimed_suspicions(session: AsyncSession, sent_before: datetime,
                               limit: int = 100) -> Sequence[OutboxMessage]:
    """The newest suspicion of each open localised incident that no validator ever claimed,
    published before ``sent_before``: the bus copy was lost (dead-lettered during a long outage,
    the stream cut) or never came."""
    newest = (select(OutboxMessage.incident_id, func.max(OutboxMessage.seq).label("seq"))
              .where(OutboxMessage.kind == "Suspicion")
              .group_by(OutboxMessage.incident_id).subquery())
    q = (select(OutboxMessage)
         .join(newest, OutboxMessage.seq == newest.c.seq)
         .join(Incident, Incident.id == OutboxMessage.incident_id)
         .where(Incident.status == "localized", OutboxMessage.sent_at < sent_before,
                ~exists().where(ValidationClaim.suspicion_id == OutboxMessage.event_id))
         .order_by(OutboxMessage.seq).limit(limit))
    return (await session.scalars(q)).all()


# ---- unfinished localisations -----------------------------------------------------------------

async def unlocalized_incidents(session: AsyncSession, dedup_prefix: str,
                                limit: int = 1000, *, jobs: JobFilter | None = None
                                ) -> Sequence[Incident]:
    """Open incidents (of the jobs ``jobs`` accepts) still at ``detected`` whose localisation
    never recorded a result (its process died while profiling, or could not commit): oldest
    first."""
    tried = exists().where(IncidentEvent.incident_id == Incident.id,
                           IncidentEvent.stage == "detected",
                           IncidentEvent.detail["by"].astext == "analyzer")
    where = await _of_jobs(session, Incident.job_id, (
        Incident.status == "detected",
        Incident.dedup_key.startswith(dedup_prefix, autoescape=True), ~tried), jobs)
    if where is None:
        return []
    return (await session.scalars(
        select(Incident).where(*where)
        .order_by(Incident.opened_at, Incident.id).limit(limit))).all()


# ---- retention --------------------------------------------------------------------------------

async def _delete_batch(session: AsyncSession, table: Any, key: Any, where: Any,
                        batch: int) -> int:
    """Delete up to ``batch`` rows matching ``where`` (short statements, short locks)."""
    ids = select(key).where(where).limit(batch).scalar_subquery()
    res = await session.execute(delete(table).where(key.in_(ids)).returning(key))
    return len(res.all())


async def delete_resolved_incidents(session: AsyncSession, before: datetime, batch: int) -> int:
    """Incidents resolved before ``before``, with their timeline, plans and claims (cascade)."""
    return await _delete_batch(session, Incident, Incident.id,
                               and_(Incident.status == "resolved", Incident.resolved_at < before),
                               batch)


async def delete_processed_events(session: AsyncSession, before: datetime, batch: int) -> int:
    ids = (select(ProcessedEvent.event_id, ProcessedEvent.consumer)
           .where(ProcessedEvent.at < before).limit(batch))
    res = await session.execute(
        delete(ProcessedEvent)
        .where(tuple_(ProcessedEvent.event_id, ProcessedEvent.consumer).in_(ids))
        .returning(ProcessedEvent.event_id))
    return len(res.all())


async def delete_webhook_attempts(session: AsyncSession, before: datetime, batch: int) -> int:
    return await _delete_batch(session, WebhookAttempt, WebhookAttempt.id,
                               WebhookAttempt.at < before, batch)


async def delete_finished_deliveries(session: AsyncSession, before: datetime, batch: int) -> int:
    return await _delete_batch(
        session, WebhookDelivery, WebhookDelivery.id,
        and_(WebhookDelivery.status.in_(("delivered", "failed", "withdrawn")),
             WebhookDelivery.created_at < before), batch)


async def delete_audit(session: AsyncSession, before: datetime, batch: int) -> int:
    return await _delete_batch(session, AuditEntry, AuditEntry.id, AuditEntry.at < before, batch)


async def delete_outbox(session: AsyncSession, before: datetime, batch: int) -> int:
    """Messages sent (or refused for good) before ``before``; unsent ones are never deleted."""
    return await _delete_batch(
        session, OutboxMessage, OutboxMessage.seq,
        or_(OutboxMessage.sent_at < before, OutboxMessage.failed_at < before), batch)


async def delete_finished_claims(session: AsyncSession, before: datetime, batch: int) -> int:
    return await _delete_batch(
        session, ValidationClaim, ValidationClaim.suspicion_id,
        and_(ValidationClaim.state != "running", ValidationClaim.finished_at < before), batch)


async def delete_idle_jobs(session: AsyncSession, before: datetime, batch: int) -> int:
    """Jobs not seen since ``before`` that have no incident left (their ranks go with them)."""
    return await _delete_batch(
        session, Job, Job.id,
        and_(Job.last_seen_at < before, ~exists().where(Incident.job_id == Job.id)), batch)
