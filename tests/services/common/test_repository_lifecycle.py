"""add_timeline moves an incident's status only as the lifecycle allows, against real Postgres:
each entry is kept, resolved_at is set once, and an illegal entry changes nothing."""

from __future__ import annotations

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from greyhound.core.lifecycle import IllegalTransition
from services.common.db import repository as repo
from services.common.db.documents import Culprit, Empty, Evidence


async def test_timeline_follows_the_lifecycle(sessions: async_sessionmaker[AsyncSession]) -> None:
    async with sessions() as session:
        await repo.touch_job(session, "life")
        incident = await repo.open_incident(
            session, job_id="life", kind="slowdown", dedup_key="slowdown", severity=1.5,
            summary="s", culprit=Culprit(), evidence=Evidence(), stage_detail=Empty())
        statuses = [incident.status]
        for stage in ("localized", "detected", "validated", "localized", "resolved"):
            statuses.append(await repo.add_timeline(session, incident, stage, Empty()))
        closed_at = incident.resolved_at
        assert statuses == ["detected", "localized", "localized", "validated", "localized",
                            "resolved"]
        assert closed_at is not None
        assert await repo.add_timeline(session, incident, "validated", Empty()) == "resolved"
        assert incident.resolved_at == closed_at  # closed once
        with pytest.raises(IllegalTransition):
            await repo.add_timeline(session, incident, "resolved", Empty())
        await session.commit()
        incident_id = incident.id
    async with sessions() as session:
        stored = await repo.get_incident(session, incident_id)
        assert stored is not None and stored.status == "resolved"
        assert [e.stage for e in sorted(stored.timeline, key=lambda e: e.id)] == [
            "detected", "localized", "detected", "validated", "localized", "resolved",
            "validated"]  # the refused entry was never added
