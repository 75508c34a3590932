"""Putting a plan in force and taking it back, in the caller's unit of work.

Each delivery is the job's next version (handed out by the database, so a job's versions rise
whichever planner delivers: services.common.db.exclusion): the state it must run from now
(micro-batches per DP group, rank -> GPU map), absolute so that a job that missed one still
ends up right, plus the GPU swaps from the previous version. The row is written with the plan's
move (greyhound.core.plan_lifecycle), its timeline note and its webhook event, all in one
commit; the caller stages the returned message in that commit too (the transactional outbox)
and sends it after (a job also reads the newest row over REST).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from greyhound.core.plan_build import JobState, Layout, next_state, undo_swaps
from greyhound.core.plans import even_split
from services.common.bus.contract import PlanMessage
from services.common.db import exclusion
from services.common.db import repository as repo
from services.common.db.documents import (
    ConsolidateParams,
    MicrobatchParams,
    PlanStep,
    RoleSwapParams,
)
from services.common.db.models import Incident, Plan
from services.common.webhooks.enqueue import decided_by, enqueue
from services.common.webhooks.payload import PlanFacts, plan_payload


def state_of(message: PlanMessage | None) -> JobState:
    """The job state a delivery's message says (None: the job's own layout)."""
    if message is None:
        return JobState()
    counts, gpus = message.microbatches, message.gpu_of_rank
    return JobState(None if counts is None else tuple(counts),
                    None if gpus is None else tuple(gpus))


async def job_state(session: AsyncSession, job_id: str) -> tuple[JobState, int]:
    """What the job runs now and the version that says so (0: nothing delivered)."""
    current = await repo.current_delivery(session, job_id)
    return (state_of(current.message), current.version) if current else (JobState(), 0)


async def _deliver(session: AsyncSession, plan: Plan, layout: Layout, action: str, *,
                   microbatches: tuple[int, ...] | None, gpu_of_rank: tuple[int, ...] | None,
                   cost_s: float | None, summary: str) -> PlanMessage:
    version = await exclusion.next_plan_version(session, plan.job_id)  # the job locked
    state, _ = await job_state(session, plan.job_id)
    new, swaps = next_state(state, layout, microbatches=microbatches, gpu_of_rank=gpu_of_rank)
    msg = PlanMessage.model_validate({
        "job_id": plan.job_id, "version": version, "plan_id": plan.id,
        "incident_id": plan.incident_id, "strategy": plan.strategy, "action": action,
        "microbatches": None if new.microbatches is None else list(new.microbatches),
        "gpu_of_rank": None if new.gpu_of_rank is None else list(new.gpu_of_rank),
        "swaps": list(swaps), "cost_s": cost_s, "summary": summary[:500]})
    await repo.add_delivery(session, job_id=plan.job_id, version=msg.version, plan_id=plan.id,
                            action=action, message=msg)
    return msg


async def deliver(session: AsyncSession, plan: Plan, layout: Layout,
                  cost_s: float | None) -> PlanMessage:
    """Put an approved plan in force: the job's next version carries its state."""
    p = plan.params
    counts = tuple(p.microbatches) if isinstance(p, MicrobatchParams) else None
    gpus = tuple(p.gpu_of_rank) if isinstance(p, RoleSwapParams | ConsolidateParams) else None
    msg = await _deliver(session, plan, layout, "apply", microbatches=counts, gpu_of_rank=gpus,
                         cost_s=cost_s, summary=p.summary or "")
    plan.version = msg.version
    return msg


async def take_back(session: AsyncSession, plan: Plan, layout: Layout, *,
                    others_in_force: list[Plan], cost_s: float | None) -> PlanMessage:
    """The delivery that undoes ``plan``: S2 returns to the newest other micro-batch plan still in
    force, else the even split; S3 exchanges its GPU swaps back."""
    counts = gpus = None
    if plan.strategy == "S2":
        other = [o.params for o in others_in_force if isinstance(o.params, MicrobatchParams)]
        counts = (tuple(other[-1].microbatches) if other
                  else even_split(layout.microbatches, layout.dp, layout.multiple_of))
    elif plan.strategy == "S3" and plan.version is not None:
        sent = await repo.get_delivery(session, plan.job_id, plan.version)
        swaps = tuple((a, b) for a, b in sent.message.swaps) if sent else ()
        state, _ = await job_state(session, plan.job_id)
        gpus = undo_swaps(state, layout, swaps)
    return await _deliver(session, plan, layout, "revert", microbatches=counts, gpu_of_rank=gpus,
                          cost_s=cost_s, summary=f"revert {plan.strategy}: "
                          f"{plan.params.summary or ''}")


async def note(session: AsyncSession, incident: Incident | None, stage: str, plan: Plan,
               **detail: Any) -> None:
    """A plan step on the incident's timeline (a note: greyhound.core.lifecycle)."""
    if incident is None:
        return
    await repo.add_timeline(session, incident, stage, PlanStep.model_validate({
        "plan_id": plan.id, "strategy": plan.strategy, "status": plan.status,
        **{k: v for k, v in detail.items() if v is not None}}))


async def announce(session: AsyncSession, plan: Plan, what: str, *, by: str | None = None,
                   note_text: str = "", dashboard: str | None = None) -> None:
    """A plan.<what> webhook event, committed with the change (services.common.webhooks.enqueue);
    an applied or reverted plan names who decided it."""
    now = datetime.now(UTC)
    if by is None and what in ("applied", "reverted"):
        by = decided_by(plan)
    event = f"plan.{what}"
    key = f"{plan.id}.{what}" if what != "applied" else f"{plan.id}.applied.{plan.version}"
    facts = PlanFacts(id=plan.id, incident_id=plan.incident_id, job_id=plan.job_id,
                      strategy=plan.strategy, status=plan.status,
                      expected_gain=plan.expected_gain, decided_by=by, note=note_text)
    await enqueue(session, event=event, key=key, incident_id=plan.incident_id,
                  payload=plan_payload(event, key, facts, occurred_at=now, dashboard=dashboard),
                  now=now)
