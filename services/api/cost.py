"""An incident's cost as the API, the metrics and the webhooks show it: the ORM row adapted to
the pure computation in greyhound.core.incident_cost (which says how the loss, the lost fraction
and a plan's saving are measured)."""

from __future__ import annotations

from datetime import datetime

from greyhound.core.incident_cost import (
    IncidentCost,
    TimelinePoint,
    incident_cost,
    localization_latency_s,
    validation_pause_s,
)
from services.common.db.models import Incident

__all__ = ["IncidentCost", "TimelinePoint", "cost_of", "localization_latency_s", "timeline_of",
           "validation_pause_s"]


def timeline_of(inc: Incident) -> list[TimelinePoint]:
    """The incident's timeline (it must be loaded) as the core reads it."""
    return [TimelinePoint(e.stage, e.at, e.detail.as_json()) for e in inc.timeline]


def cost_of(inc: Incident, *, gpus: int | None, now: datetime) -> IncidentCost:
    return incident_cost(kind=inc.kind, opened_at=inc.opened_at, resolved_at=inc.resolved_at,
                         timeline=timeline_of(inc), gpus=gpus, now=now)
