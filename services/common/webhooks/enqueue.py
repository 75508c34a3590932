"""Turning an event into pending deliveries, in the caller's unit of work.

The notifier calls this for bus events and the API for its own events (plan decisions, test
sends); either way the rows are committed with the change that caused them and the notifier's
sender picks them up, so nothing is announced that did not happen and nothing that happened is
lost to a crash between the commit and the HTTP call.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from services.common.db import repository as repo
from services.common.db.models import Incident, Plan
from services.common.incident_cost import cost_of, job_gpus
from services.common.webhooks.payload import IncidentFacts, for_format, wants


async def enqueue(session: AsyncSession, *, event: str, key: str, payload: Mapping[str, Any],
                  incident_id: str | None, now: datetime | None = None,
                  held: bool = False) -> int:
    """One delivery per enabled webhook that wants ``event``, due now or, ``held``, kept until
    its incident pages (repository.release_held_deliveries); how many were new."""
    now = now or datetime.now(UTC)
    made = 0
    for hook in await repo.list_webhooks(session, enabled_only=True):
        if not wants(hook.events, event):
            continue
        row = await repo.enqueue_delivery(
            session, webhook_id=hook.id, event_id=key, event=event, incident_id=incident_id,
            payload=for_format(payload, hook.format), due=None if held else now)
        made += row is not None
    return made


def decided_by(plan: Plan) -> str | None:
    """Who decided ``plan`` (an operator's token name, or ``policy`` for an automatic one), for
    the events that follow the decision (applied, reverted); its approvals must be loaded."""
    return plan.approvals[-1].approver if plan.approvals else None


async def incident_facts(session: AsyncSession, inc: Incident,
                         now: datetime | None = None) -> IncidentFacts:
    """The incident as a message shows it, with its cost so far (the timeline must be loaded)."""
    cost = cost_of(inc, gpus=await job_gpus(session, inc.job_id), now=now or datetime.now(UTC))
    return IncidentFacts(id=inc.id, job_id=inc.job_id, kind=inc.kind, status=inc.status,
                         severity=inc.severity, summary=inc.summary, culprit=inc.culprit,
                         opened_at=inc.opened_at, resolved_at=inc.resolved_at,
                         gpu_hours_lost=cost.gpu_hours_lost)
