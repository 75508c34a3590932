"""Incidents: filtered lists, the detail with timeline, evidence and cost, acknowledging and
closing with a note."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Response

from greyhound.core import incident_kinds, lifecycle
from services.api.auth import Operator, Viewer
from services.api.deps import Session, Unit, problems
from services.api.errors import Conflict, Invalid, NotFound
from services.api.schemas import (
    AuditOut,
    CostOut,
    IncidentDetailOut,
    IncidentOut,
    Note,
    PlanOut,
    RequiredNote,
)
from services.common.bus.contract import IncidentEvent, Subjects
from services.common.db import repository as repo
from services.common.db.documents import OperatorNote
from services.common.db.models import Incident
from services.common.incident_cost import cost_of, job_gpus

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/incidents", tags=["incidents"])
# "open": every incident not resolved yet; else one of the lifecycle's statuses.
StatusFilter = Literal["open", lifecycle.Status]


async def _cost(session: Session, inc: Incident, gpus: dict[str, int | None]) -> CostOut:
    if inc.job_id not in gpus:
        gpus[inc.job_id] = await job_gpus(session, inc.job_id)
    c = cost_of(inc, gpus=gpus[inc.job_id], now=datetime.now(UTC))
    return CostOut.model_validate(c)


async def incident_out(session: Session, inc: Incident,
                       gpus: dict[str, int | None] | None = None) -> IncidentOut:
    out = IncidentOut.model_validate(inc)
    out.cost = await _cost(session, inc, {} if gpus is None else gpus)
    return out


@router.get("", response_model=list[IncidentOut], summary="Incidents, newest first",
            description="Filters: job, kind (a trailing `*` matches a prefix, e.g. `hang*`), "
                        "status (a stage, or `open` for every unresolved one; an unknown kind or "
                        "status is a 422 that lists the valid values) and the opening "
                        "time range [opened_after, opened_before). Paged with limit/offset; the "
                        "total is in the X-Total-Count header. Each incident carries its cost "
                        "in GPU-hours.", responses=problems(422))
async def list_incidents(
    session: Session, response: Response, _: Viewer,
    job_id: Annotated[str | None, Query(max_length=128)] = None,
    status: StatusFilter | None = None,
    kind: Annotated[str | None, Query(max_length=64)] = None,
    opened_after: datetime | None = None,
    opened_before: datetime | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
) -> list[IncidentOut]:
    for t in (opened_after, opened_before):
        if t is not None and t.tzinfo is None:
            raise Invalid("opened_after/opened_before need a time zone (e.g. ...Z)")
    if kind is not None and not incident_kinds.matching(kind):
        raise Invalid(f"kind {kind!r} matches no incident kind; the kinds are "
                      f"{', '.join(incident_kinds.KINDS)} (a trailing * matches a prefix: hang*)")
    rows = await repo.list_incidents(session, job_id=job_id, status=status, kind=kind,
                                     opened_after=opened_after, opened_before=opened_before,
                                     limit=limit, offset=offset)
    total = await repo.count_incidents(session, job_id=job_id, status=status, kind=kind,
                                       opened_after=opened_after, opened_before=opened_before)
    response.headers["X-Total-Count"] = str(total)
    gpus: dict[str, int | None] = {}
    return [await incident_out(session, i, gpus) for i in rows]


async def _get(session: Session, incident_id: str) -> Incident:
    inc = await repo.get_incident(session, incident_id)
    if inc is None:
        raise NotFound(f"incident {incident_id!r} not found")
    return inc


@router.get("/{incident_id}", response_model=IncidentDetailOut,
            summary="One incident: timeline, evidence, cost, plans and audit trail",
            responses=problems(404))
async def get_incident(incident_id: str, session: Session, _: Viewer) -> IncidentDetailOut:
    inc = await _get(session, incident_id)
    base = await incident_out(session, inc)
    plans = await repo.list_plans(session, incident_id=inc.id)
    audit = await repo.incident_audit(session, inc.id, [p.id for p in plans])
    return IncidentDetailOut(**base.model_dump(),
                             plans=[PlanOut.model_validate(p) for p in plans],
                             audit=[AuditOut.model_validate(a) for a in audit])


async def _reload(session: Session, incident_id: str) -> IncidentOut:
    """The incident as this request's unit of work leaves it (written, not committed yet)."""
    await session.flush()
    session.expunge_all()
    return await incident_out(session, await _get(session, incident_id))


async def _unresolved_for_update(session: Session, incident_id: str) -> Incident:
    """The incident, locked for this transaction; 404 if there is none, 409 once it is resolved
    (a closed incident takes no acknowledgement and no second closing)."""
    inc = await repo.get_incident_for_update(session, incident_id)
    if inc is None:
        raise NotFound(f"incident {incident_id!r} not found")
    if not lifecycle.is_open(inc.status):
        raise Conflict(f"incident {incident_id} is already resolved")
    return inc


@router.post("/{incident_id}/ack", response_model=IncidentOut,
             summary="Acknowledge an incident (someone is on it)",
             description="Needs operator. 409 when it is already acknowledged or resolved.",
             responses=problems(404, 409, 422))
async def acknowledge(incident_id: str, body: Note, session: Session,
                      who: Operator) -> IncidentOut:
    inc = await _unresolved_for_update(session, incident_id)
    if inc.acknowledged_at is not None:
        raise Conflict(f"incident {incident_id} was acknowledged by {inc.acknowledged_by}")
    inc.acknowledged_at = datetime.now(UTC)
    inc.acknowledged_by = who.name
    # The lifecycle keeps the status on an acknowledgement (greyhound.core.lifecycle.advance).
    await repo.add_timeline(session, inc, "acknowledged", OperatorNote(by=who.name, note=body.note))
    await repo.audit(session, actor=who.name, token_id=who.token_id, action="incident.ack",
                     target_type="incident", target_id=inc.id, note=body.note)
    return await _reload(session, incident_id)


@router.post("/{incident_id}/close", response_model=IncidentOut,
             summary="Close (resolve) an incident by hand, with the reason",
             description="Needs operator and a note. The resolution is announced like the "
                         "tracker's (webhooks get incident.resolved). 409 when already resolved.",
             responses=problems(404, 409, 422))
async def close(incident_id: str, body: RequiredNote, uow: Unit, who: Operator) -> IncidentOut:
    session = uow.session
    inc = await _unresolved_for_update(session, incident_id)
    await repo.add_timeline(session, inc, "resolved",
                            OperatorNote(by=who.name, note=body.note, manual=True))
    await repo.audit(session, actor=who.name, token_id=who.token_id, action="incident.close",
                     target_type="incident", target_id=inc.id, note=body.note)
    await uow.stage(Subjects.incident(inc.job_id), IncidentEvent(
        job_id=inc.job_id, incident_id=inc.id, stage="resolved", kind=inc.kind,
        severity=inc.severity, summary=f"{inc.summary} (closed by {who.name})"))
    return await _reload(session, incident_id)
