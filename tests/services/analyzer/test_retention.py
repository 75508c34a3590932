"""Retention on a real Postgres: what is past its age goes, what is open, recent or unsent stays,
claims outlive the events stream's retention, and one pass runs at a time."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from services.analyzer.retention import RETENTION_LOCK, retention_pass
from services.analyzer.settings import AnalyzerSettings
from services.common.db.documents import Topology
from services.common.db.models import (
    AuditEntry,
    Incident,
    IncidentEvent,
    Job,
    OutboxMessage,
    ProcessedEvent,
    Rank,
    ValidationClaim,
    Webhook,
    WebhookAttempt,
    WebhookDelivery,
)
from services.common.unit_of_work import Work

NOW = datetime(2027, 6, 1, tzinfo=UTC)
DAY = 86400.0


def ago(days: float) -> datetime:
    return NOW - timedelta(days=days)


async def seed(s: async_sessionmaker[AsyncSession]) -> None:
    async with s() as session:
        session.add_all([Job(id="gone", topology=Topology(), first_seen_at=ago(300), last_seen_at=ago(200)),
                         Job(id="live", topology=Topology(), first_seen_at=ago(300), last_seen_at=ago(1))])
        await session.flush()
        session.add(Rank(job_id="gone", rank=0, host="h", device=0, pid=1, agent_id="a"))
        session.add_all([
            Incident(id="old-resolved", job_id="gone", kind="k", status="resolved",
                     dedup_key="a", opened_at=ago(120), resolved_at=ago(100)),
            Incident(id="new-resolved", job_id="live", kind="k", status="resolved",
                     dedup_key="b", opened_at=ago(20), resolved_at=ago(10)),
            Incident(id="old-open", job_id="live", kind="k", status="localized",
                     dedup_key="c", opened_at=ago(200))])
        await session.flush()
        session.add_all([
            IncidentEvent(incident_id="old-resolved", stage="resolved", at=ago(100)),
            IncidentEvent(incident_id="old-open", stage="localized", at=ago(200)),
            ProcessedEvent(event_id="p-old", consumer="analyzer", at=ago(40)),
            ProcessedEvent(event_id="p-new", consumer="analyzer", at=ago(20)),
            ValidationClaim(suspicion_id="c-old", incident_id="old-open", job_id="live",
                            suspicion="{}", state="done", holder="v", lease_until=ago(40),
                            finished_at=ago(40)),
            ValidationClaim(suspicion_id="c-running", incident_id="old-open", job_id="live",
                            suspicion="{}", state="running", holder="v", lease_until=ago(40)),
            AuditEntry(actor="a", action="x", target_type="t", target_id="1", at=ago(400)),
            AuditEntry(actor="a", action="x", target_type="t", target_id="2", at=ago(100)),
            OutboxMessage(event_id="o-sent", subject="s", kind="k", payload="{}", producer="p",
                          created_at=ago(10), sent_at=ago(10)),
            OutboxMessage(event_id="o-unsent", subject="s", kind="k", payload="{}", producer="p",
                          created_at=ago(10))])
        hook = Webhook(name="h", url="http://x", secret_enc="", events=[])
        session.add(hook)
        await session.flush()
        done = WebhookDelivery(webhook_id=hook.id, event_id="d1", status="delivered",
                               created_at=ago(40))
        waiting = WebhookDelivery(webhook_id=hook.id, event_id="d2", status="pending",
                                  created_at=ago(40))
        session.add_all([done, waiting])
        await session.flush()
        session.add_all([WebhookAttempt(delivery_id=waiting.id, outcome="failed", at=ago(40)),
                         WebhookAttempt(delivery_id=waiting.id, outcome="failed", at=ago(1))])
        await session.commit()


async def ids(s: async_sessionmaker[AsyncSession], column: object) -> list[str]:
    async with s() as session:
        return sorted(str(x) for x in await session.scalars(select(column)))  # type: ignore[call-overload]


async def test_old_rows_go_and_open_recent_or_unsent_ones_stay(
        sessions: async_sessionmaker[AsyncSession]) -> None:
    await seed(sessions)
    deleted = await retention_pass(Work(sessions), AnalyzerSettings(retention_batch=1),
                                   events_max_age_s=30 * DAY, now=NOW)
    assert deleted is not None
    assert await ids(sessions, Incident.id) == ["new-resolved", "old-open"]
    assert await ids(sessions, IncidentEvent.stage) == ["localized"]  # went with its incident
    assert await ids(sessions, ProcessedEvent.event_id) == ["p-new"]
    assert await ids(sessions, ValidationClaim.suspicion_id) == ["c-running"]
    assert await ids(sessions, AuditEntry.target_id) == ["2"]
    assert await ids(sessions, OutboxMessage.event_id) == ["o-unsent"]
    assert await ids(sessions, WebhookDelivery.event_id) == ["d2"]
    async with sessions() as session:
        attempts = await session.scalar(select(func.count()).select_from(WebhookAttempt))
    assert attempts == 1
    assert await ids(sessions, Job.id) == ["live"]  # idle and without incidents: gone
    assert await ids(sessions, Rank.job_id) == []
    assert deleted == {"resolved_incidents": 1, "processed_events": 1, "validation_claims": 1,
                       "webhook_deliveries": 1, "webhook_attempts": 1, "audit_log": 1,
                       "outbox": 1, "jobs": 1}


async def test_claims_outlive_the_events_stream(sessions: async_sessionmaker[AsyncSession]) -> None:
    """A stream that keeps events 60 days may replay a 40-day-old one: its claim must stay."""
    await seed(sessions)
    await retention_pass(Work(sessions), AnalyzerSettings(), events_max_age_s=60 * DAY, now=NOW)
    assert await ids(sessions, ProcessedEvent.event_id) == ["p-new", "p-old"]
    assert await ids(sessions, ValidationClaim.suspicion_id) == ["c-old", "c-running"]


async def test_one_pass_at_a_time(sessions: async_sessionmaker[AsyncSession]) -> None:
    await seed(sessions)
    async with sessions() as holder:
        await holder.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": RETENTION_LOCK})
        assert await retention_pass(Work(sessions), AnalyzerSettings(), events_max_age_s=30 * DAY,
                                    now=NOW) is None
        await holder.rollback()
    assert await ids(sessions, AuditEntry.target_id) == ["1", "2"]  # nothing deleted meanwhile
