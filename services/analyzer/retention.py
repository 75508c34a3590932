"""Retention: every table stops growing; rows past their settings' age are deleted.

The analyzer runs it: it is the one service that always has the database, it owns the incident
lifecycle (what "resolved" means), and it is on no latency-critical path (the tracker is the hot
path, the validator holds paused jobs, the API is request-driven and may be replicated).
Several analyzers may run: every delete batch takes a transaction-scoped advisory lock, and a
pass that finds it taken stops (another process is doing the work).

What goes, and after how long (AnalyzerSettings):

* resolved incidents, ``keep_resolved_days`` after they were resolved, with their timeline,
  plans, approvals and validation claims (cascades); open incidents are never deleted;
* processed-event claims and finished validation claims, ``keep_processed_days``, but never
  sooner than the events stream keeps its messages (``events_max_age_s``): a message replayed
  from the stream must still find its claim, or it would be handled (a job paused) twice;
* webhook attempts, and deliveries that were delivered or failed, ``keep_webhook_days``;
* audit log entries, ``keep_audit_days``;
* outbox messages sent (or refused for good), ``keep_outbox_days``; unsent ones never;
* jobs not seen for ``keep_idle_jobs_days`` that have no incident left (their ranks go too).

Streams and the tracker's state bucket bound themselves (max age, max bytes: see
services.common.bus.streams and services.tracker.state_store).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncSession

from services.analyzer.settings import AnalyzerSettings
from services.common.bus.errors import classify, describe
from services.common.db import repository as repo
from services.common.unit_of_work import Work

log = logging.getLogger(__name__)

RETENTION_LOCK = 0x67726574  # "gret"
DAY_S = 86400.0

Deleter = Callable[[AsyncSession, datetime, int], Awaitable[int]]


def _plan(s: AnalyzerSettings, events_max_age_s: float) -> list[tuple[str, float, Deleter]]:
    """(what, keep seconds, delete function), in an order that lets cascades do most work."""
    claims_s = max(s.keep_processed_days * DAY_S, events_max_age_s + DAY_S)
    return [
        ("resolved_incidents", s.keep_resolved_days * DAY_S, repo.delete_resolved_incidents),
        ("processed_events", claims_s, repo.delete_processed_events),
        ("validation_claims", claims_s, repo.delete_finished_claims),
        ("webhook_deliveries", s.keep_webhook_days * DAY_S, repo.delete_finished_deliveries),
        ("webhook_attempts", s.keep_webhook_days * DAY_S, repo.delete_webhook_attempts),
        ("audit_log", s.keep_audit_days * DAY_S, repo.delete_audit),
        ("outbox", s.keep_outbox_days * DAY_S, repo.delete_outbox),
        ("jobs", s.keep_idle_jobs_days * DAY_S, repo.delete_idle_jobs),
    ]


async def retention_pass(work: Work, settings: AnalyzerSettings, *, events_max_age_s: float,
                         now: datetime | None = None) -> dict[str, int] | None:
    """Delete what is past its age; rows deleted per table, or None when another process is
    running a pass. Each batch is its own short unit of work."""
    now = now or datetime.now(UTC)
    deleted: dict[str, int] = {}
    for what, keep_s, delete in _plan(settings, events_max_age_s):
        before = now - timedelta(seconds=keep_s)
        total = 0
        while True:
            async with work.unit() as uow:
                if not await repo.try_lock(uow.session, RETENTION_LOCK):
                    uow.discard()
                    return None
                n = await delete(uow.session, before, settings.retention_batch)
            total += n
            if n < settings.retention_batch:
                break
        deleted[what] = total
    return deleted


async def run_retention(work: Work, settings: AnalyzerSettings, stop: asyncio.Event, *,
                        events_max_age_s: float) -> None:
    """A pass at start-up and every ``retention_every_s``; the database being away is waited
    out, any other failure (a bug) ends the task, hence the service."""
    while not stop.is_set():
        try:
            deleted = await retention_pass(work, settings, events_max_age_s=events_max_age_s)
        except Exception as exc:
            if classify(exc) == "permanent":
                raise
            log.warning("retention pass failed; next one in %.0fs: %s",
                        settings.retention_every_s, describe(exc))
        else:
            if deleted and any(deleted.values()):
                log.info("retention deleted %s", {k: v for k, v in deleted.items() if v})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), settings.retention_every_s)
