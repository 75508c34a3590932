"""All SQL lives here. Functions take the caller's session and never commit: the caller owns the
unit of work (a request, or one bus message) and commits once, then acks or publishes."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import selectinload

from services.common.db.models import Incident, IncidentEvent, Job, ProcessedEvent, Rank


async def ping(session: AsyncSession) -> None:
    """A round trip to the database (health checks)."""
    await session.execute(text("select 1"))


async def claim_event(session: AsyncSession, consumer: str, event_id: str) -> bool:
    """Record that ``consumer`` handles ``event_id``; False when it was handled before."""
    stmt = (insert(ProcessedEvent).values(event_id=event_id, consumer=consumer)
            .on_conflict_do_nothing().returning(ProcessedEvent.event_id))
    return (await session.execute(stmt)).first() is not None


async def touch_job(session: AsyncSession, job_id: str, *, world_size: int | None = None,
                    topology: dict[str, Any] | None = None) -> None:
    values: dict[str, Any] = {"id": job_id, "last_seen_at": func.now()}
    update: dict[str, Any] = {"last_seen_at": func.now()}
    if world_size is not None:
        values["world_size"] = update["world_size"] = world_size
    if topology is not None:
        values["topology"] = update["topology"] = topology
    else:
        values["topology"] = {}
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
              "agent_id": stmt.excluded.agent_id, "last_seen_at": func.now()}))


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


async def open_incident(session: AsyncSession, *, job_id: str, kind: str, dedup_key: str,
                        severity: float, summary: str, culprit: dict[str, Any],
                        evidence: dict[str, Any], stage_detail: dict[str, Any]) -> Incident:
    incident = Incident(job_id=job_id, kind=kind, dedup_key=dedup_key, severity=severity,
                        summary=summary, culprit=culprit, evidence=evidence, status="detected")
    session.add(incident)
    await session.flush()
    await add_timeline(session, incident, "detected", stage_detail)
    return incident


async def add_timeline(session: AsyncSession, incident: Incident, stage: str,
                       detail: dict[str, Any]) -> None:
    session.add(IncidentEvent(incident_id=incident.id, stage=stage, detail=detail))
    incident.updated_at = datetime.now(UTC)
    if stage == "resolved":
        incident.status = "resolved"
        incident.resolved_at = datetime.now(UTC)
    elif stage != "detected":
        incident.status = stage


async def list_incidents(session: AsyncSession, *, job_id: str | None = None,
                         status: str | None = None, kind: str | None = None,
                         limit: int = 100, offset: int = 0) -> Sequence[Incident]:
    q = select(Incident).options(selectinload(Incident.timeline))
    if job_id is not None:
        q = q.where(Incident.job_id == job_id)
    if status is not None:
        q = q.where(Incident.status == status)
    if kind is not None:
        q = q.where(Incident.kind == kind)
    q = q.order_by(Incident.opened_at.desc(), Incident.id).limit(limit).offset(offset)
    return (await session.scalars(q)).all()


async def get_incident(session: AsyncSession, incident_id: str) -> Incident | None:
    return await session.scalar(select(Incident).where(Incident.id == incident_id)
                                .options(selectinload(Incident.timeline)))


async def job_ranks(session: AsyncSession, job_id: str) -> Sequence[Rank]:
    """Every known rank of a job (which agent serves it, on which host and device)."""
    return (await session.scalars(select(Rank).where(Rank.job_id == job_id)
                                  .order_by(Rank.rank))).all()


async def get_incident_for_update(session: AsyncSession, incident_id: str) -> Incident | None:
    return await session.scalar(select(Incident).where(Incident.id == incident_id)
                                .with_for_update())
