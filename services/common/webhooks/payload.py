"""The webhook body: one stable, documented JSON schema (``greyhound.webhook.v1``, described in
docs/webhooks.md) that is also a valid Slack message (``text`` plus ``blocks``).

A webhook in ``slack`` format receives only ``text`` and ``blocks`` (what a Slack incoming
webhook accepts); in ``json`` format it receives the whole document.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, Protocol

from services.common.db.documents import Culprit

SCHEMA = "greyhound.webhook.v1"
INCIDENT_EVENTS = ("incident.opened", "incident.localized", "incident.validated",
                   "incident.mitigated", "incident.resolved")
PLAN_EVENTS = ("plan.proposed", "plan.approved", "plan.rejected", "plan.applied", "plan.reverted")
EVENTS = (*INCIDENT_EVENTS, *PLAN_EVENTS, "webhook.test")
STAGE_EVENT = {"detected": "incident.opened", "localized": "incident.localized",
               "validated": "incident.validated", "mitigated": "incident.mitigated",
               "resolved": "incident.resolved"}
Format = Literal["json", "slack"]
FORMATS: tuple[Format, ...] = ("json", "slack")
_EMOJI = {"incident.opened": ":rotating_light:", "incident.localized": ":mag:",
          "incident.validated": ":white_check_mark:", "incident.mitigated": ":hammer_and_wrench:",
          "incident.resolved": ":large_green_circle:", "webhook.test": ":wave:"}


class Staged(Protocol):
    """What ``pages`` reads of an incident (services.common.db.models.Incident)."""

    @property
    def only_suspected(self) -> bool: ...


def pages(incident: Staged) -> bool:
    """Whether an incident's events go to webhooks: not while it is only suspected. A slowdown
    a short transient could explain is confirmed or withdrawn within iterations; profiling it
    costs the job little, paging a person for it costs a person. A hang, a confirmed slowdown
    and an incident from before there were two stages page."""
    return not incident.only_suspected


def delivery_key(event: str, incident_id: str, bus_event_id: str) -> str:
    """The idempotency key. An incident opens and resolves once, whatever the bus repeats (every
    further detection of an open incident is also published as ``detected``), so those two are
    keyed by the incident; a localisation or validation can happen again with new findings, so
    those are keyed by the bus event."""
    if event in ("incident.opened", "incident.resolved"):
        return f"{incident_id}.{event.split('.', 1)[1]}"
    return bus_event_id


@dataclass(frozen=True)
class IncidentFacts:
    id: str
    job_id: str
    kind: str
    status: str
    severity: float
    summary: str
    culprit: Culprit
    opened_at: datetime
    resolved_at: datetime | None
    gpu_hours_lost: float | None


@dataclass(frozen=True)
class PlanFacts:
    id: str
    incident_id: str
    job_id: str
    strategy: str
    status: str
    expected_gain: float | None
    decided_by: str | None
    note: str


def _iso(t: datetime | None) -> str | None:
    return None if t is None else t.isoformat().replace("+00:00", "Z")


def culprit_text(culprit: Culprit) -> str:
    """The culprit in a few words for a human (the JSON body carries the whole object)."""
    parts: list[str] = []
    if culprit.gpus:
        parts.append("GPU " + ", ".join(f"{g.host}:{g.device} (rank {g.rank})"
                                        for g in culprit.gpus[:4]))
    if culprit.links:
        parts.append("link " + ", ".join("-".join(map(str, pair)) for pair in culprit.links[:4]))
    if not parts and culprit.ranks:
        parts.append(f"ranks {culprit.ranks[:8]}")
    if culprit.comm_id is not None and not parts:
        parts.append(f"communicator {culprit.comm_id}")
    return "; ".join(parts) or "not localised yet"


def _blocks(title: str, fields: list[tuple[str, str]], link: str | None) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [
        {"type": "section", "text": {"type": "mrkdwn", "text": title}},
        {"type": "section", "fields": [{"type": "mrkdwn", "text": f"*{k}*\n{v}"}
                                       for k, v in fields[:10]]},
    ]
    if link:
        blocks.append({"type": "context", "elements": [
            {"type": "mrkdwn", "text": f"<{link}|Open in the Greyhound dashboard>"}]})
    return blocks


def incident_payload(event: str, key: str, inc: IncidentFacts, *, occurred_at: datetime,
                     dashboard: str | None) -> dict[str, Any]:
    link = f"{dashboard.rstrip('/')}/#/incidents/{inc.id}" if dashboard else None
    cost = "n/a" if inc.gpu_hours_lost is None else f"{inc.gpu_hours_lost:.1f} GPU-hours"
    what = event.split(".", 1)[1]
    title = f"{_EMOJI.get(event, '')} *Incident {what}* — {inc.summary}".strip()
    fields = [("Job", inc.job_id), ("Kind", inc.kind), ("Status", inc.status),
              ("Culprit", culprit_text(inc.culprit)), ("Severity", f"{inc.severity:.2f}"),
              ("Cost so far", cost)]
    return {
        "schema": SCHEMA, "id": key, "event": event, "occurred_at": _iso(occurred_at),
        "text": f"[greyhound] incident {what}: {inc.summary}",
        "blocks": _blocks(title, fields, link),
        "incident": {"id": inc.id, "job_id": inc.job_id, "kind": inc.kind, "status": inc.status,
                     "severity": inc.severity, "summary": inc.summary,
                     "culprit": inc.culprit.as_json(), "opened_at": _iso(inc.opened_at),
                     "resolved_at": _iso(inc.resolved_at), "gpu_hours_lost": inc.gpu_hours_lost,
                     "url": link},
        "plan": None,
    }


def plan_payload(event: str, key: str, plan: PlanFacts, *, occurred_at: datetime,
                 dashboard: str | None) -> dict[str, Any]:
    link = f"{dashboard.rstrip('/')}/#/incidents/{plan.incident_id}" if dashboard else None
    what = event.split(".", 1)[1]
    by = f" by {plan.decided_by}" if plan.decided_by else ""
    gain = "n/a" if plan.expected_gain is None else f"{plan.expected_gain:.2f}x"
    title = f"*Plan {what}{by}* — {plan.strategy} for job {plan.job_id}"
    fields = [("Job", plan.job_id), ("Strategy", plan.strategy), ("Status", plan.status),
              ("Expected gain", gain)] + ([("Note", plan.note)] if plan.note else [])
    return {
        "schema": SCHEMA, "id": key, "event": event, "occurred_at": _iso(occurred_at),
        "text": f"[greyhound] plan {what}{by}: {plan.strategy} for job {plan.job_id}",
        "blocks": _blocks(title, fields, link),
        "incident": None,
        "plan": {"id": plan.id, "incident_id": plan.incident_id, "job_id": plan.job_id,
                 "strategy": plan.strategy, "status": plan.status,
                 "expected_gain": plan.expected_gain, "decided_by": plan.decided_by,
                 "note": plan.note, "url": link},
    }


def ping_payload(key: str, webhook_name: str, *, occurred_at: datetime) -> dict[str, Any]:
    text = f"[greyhound] test delivery to webhook {webhook_name!r}: signatures and routing work"
    return {"schema": SCHEMA, "id": key, "event": "webhook.test", "occurred_at": _iso(occurred_at),
            "text": text, "blocks": _blocks(f":wave: {text}", [("Webhook", webhook_name)], None),
            "incident": None, "plan": None}


def for_format(payload: Mapping[str, Any], fmt: str) -> dict[str, Any]:
    if fmt == "slack":
        return {"text": payload["text"], "blocks": payload["blocks"]}
    return dict(payload)


def wants(events: list[str], event: str) -> bool:
    """A webhook with no event list gets every event except tests (which are sent on request)."""
    return event in events if events else event != "webhook.test"
