"""Mitigation plans: read them, and approve or reject a proposed one (operator).

The planner service writes plans (status ``proposed``); a decision is recorded as an approval
row, moves the plan to ``approved`` or ``rejected`` (greyhound.core.plan_lifecycle), lands in
the audit log and on the incident's timeline and is announced to webhooks (plan.approved /
plan.rejected) in the same commit; the planner then delivers an approved plan to the job. A
proposal past its expiry is not decided any more. Deciding on a plan that is not
awaiting a decision is a 409, so two operators clicking at once get one decision and one clear
refusal.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query

from greyhound.core.plan_lifecycle import PlanStatus
from services.api.auth import Operator, Viewer
from services.api.deps import Session, SettingsDep, problems
from services.api.errors import Conflict, NotFound
from services.api.schemas import Note, PlanOut
from services.api.tokens import Principal
from services.common.db import repository as repo
from services.common.db.documents import PlanStep
from services.common.webhooks.enqueue import enqueue
from services.common.webhooks.payload import PlanFacts, plan_payload

router = APIRouter(prefix="/v1/plans", tags=["plans"])


@router.get("", response_model=list[PlanOut], summary="Mitigation plans, newest first",
            description="Filters: job, incident and status (an unknown status is a 422 that "
                        "lists the statuses).", responses=problems(422))
async def list_plans(session: Session, _: Viewer,
                     job_id: Annotated[str | None, Query(max_length=128)] = None,
                     incident_id: Annotated[str | None, Query(max_length=32)] = None,
                     status: PlanStatus | None = None,
                     limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                     offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0) -> list[PlanOut]:
    rows = await repo.list_plans(session, job_id=job_id, incident_id=incident_id, status=status,
                                 limit=limit, offset=offset)
    return [PlanOut.model_validate(p) for p in rows]


@router.get("/{plan_id}", response_model=PlanOut, summary="One plan with its decisions",
            responses=problems(404))
async def get_plan(plan_id: str, session: Session, _: Viewer) -> PlanOut:
    plan = await repo.get_plan(session, plan_id)
    if plan is None:
        raise NotFound(f"plan {plan_id!r} not found")
    return PlanOut.model_validate(plan)


async def _decide(session: Session, settings: SettingsDep, plan_id: str, decision: str,
                  note: str, who: Principal) -> PlanOut:
    plan = await repo.get_plan(session, plan_id, for_update=True)
    if plan is None:
        raise NotFound(f"plan {plan_id!r} not found")
    if plan.status != "proposed":
        raise Conflict(f"plan {plan_id} is {plan.status}, not awaiting a decision")
    if plan.expires_at is not None and plan.expires_at <= datetime.now(UTC):
        raise Conflict(f"plan {plan_id} expired at {plan.expires_at.isoformat()}: the planner "
                       "proposes again if the loss still pays for it")
    await repo.decide_plan(session, plan, decision=decision, approver=who.name, comment=note)
    action = "approved" if decision == "approve" else "rejected"
    incident = await repo.get_incident_for_update(session, plan.incident_id)
    if incident is not None:
        await repo.add_timeline(session, incident, f"plan_{action}",
                                PlanStep(plan_id=plan.id, strategy=plan.strategy,
                                         status=plan.status, by=who.name, note=note))
    await repo.audit(session, actor=who.name, token_id=who.token_id, action=f"plan.{decision}",
                     target_type="plan", target_id=plan.id, note=note,
                     detail={"incident_id": plan.incident_id, "strategy": plan.strategy})
    now = datetime.now(UTC)
    event = f"plan.{action}"
    key = f"{plan.id}.{action}"
    facts = PlanFacts(id=plan.id, incident_id=plan.incident_id, job_id=plan.job_id,
                      strategy=plan.strategy, status=plan.status,
                      expected_gain=plan.expected_gain, decided_by=who.name, note=note)
    await enqueue(session, event=event, key=key, incident_id=plan.incident_id,
                  payload=plan_payload(event, key, facts, occurred_at=now,
                                       dashboard=settings.api_public_url), now=now)
    await session.flush()  # what this unit wrote, read back as it will be committed
    session.expunge_all()
    fresh = await repo.get_plan(session, plan_id)
    assert fresh is not None
    return PlanOut.model_validate(fresh)


@router.post("/{plan_id}/approve", response_model=PlanOut, summary="Approve a proposed plan",
             description="Needs operator. 409 unless the plan is proposed.",
             responses=problems(404, 409, 422))
async def approve(plan_id: str, body: Note, session: Session, settings: SettingsDep,
                  who: Operator) -> PlanOut:
    return await _decide(session, settings, plan_id, "approve", body.note, who)


@router.post("/{plan_id}/reject", response_model=PlanOut, summary="Reject a proposed plan",
             description="Needs operator. 409 unless the plan is proposed.",
             responses=problems(404, 409, 422))
async def reject(plan_id: str, body: Note, session: Session, settings: SettingsDep,
                 who: Operator) -> PlanOut:
    return await _decide(session, settings, plan_id, "reject", body.note, who)
