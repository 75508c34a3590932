"""An incident's cost as the API, the metrics and the webhooks show it: the row and its typed
timeline adapted to the pure computation in greyhound.core.incident_cost (which says how the
loss, the lost fraction and a plan's saving are measured)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncSession

from greyhound.core.incident_cost import IncidentCost, TimelinePoint, incident_cost
from services.common.db import repository as repo
from services.common.db.documents import Detection, Note, PlanStep
from services.common.db.models import Incident


def point(stage: str, at: datetime, note: Note) -> TimelinePoint:
    """One timeline entry as the core reads it: a detection's levels, a plan step's cost."""
    if isinstance(note, Detection):
        return TimelinePoint(stage, at, before_s=note.before_s, after_s=note.after_s,
                             first_iteration=note.first_iteration,
                             detected_iteration=note.detected_iteration,
                             further=note.further is not None)
    if isinstance(note, PlanStep):
        return TimelinePoint(stage, at, plan_id=note.plan_id, cost_s=note.cost_s)
    return TimelinePoint(stage, at)


def timeline_of(inc: Incident) -> list[TimelinePoint]:
    """The incident's timeline (it must be loaded) as the core reads it."""
    return [point(e.stage, e.at, e.detail) for e in inc.timeline]


def cost_of(inc: Incident, *, gpus: int | None, now: datetime) -> IncidentCost:
    return incident_cost(kind=inc.kind, opened_at=inc.opened_at, resolved_at=inc.resolved_at,
                         timeline=timeline_of(inc), gpus=gpus, now=now)


def validation_pause_s(inc: Incident) -> float | None:
    """How long the validator held the job paused for its checks, when it ran them."""
    v = inc.evidence.validation
    return v.pause_s if v is not None and v.pause_s is not None and v.pause_s > 0 else None


async def job_gpus(session: AsyncSession, job_id: str) -> int | None:
    """The job's size: as its agents declared it, else the ranks they announced."""
    jobs = await repo.jobs_by_id(session, [job_id])
    job = jobs.get(job_id)
    if job is not None and job.world_size:
        return job.world_size
    return (await repo.rank_counts(session, [job_id])).get(job_id) or None
