"""A relay sends only its own service's messages: on an authenticated bus a service may publish
only its own subjects, so a row of another producer would fail (a timeout) every pass and hold
the relay's lock; it stays for its own producer's relay."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from services.common.db import repository as repo
from services.common.outbox import Outbox


class RecordingJs:
    def __init__(self) -> None:
        self.subjects: list[str] = []

    async def publish(self, subject: str, payload: bytes, headers: dict[str, str]) -> Any:
        self.subjects.append(subject)
        return SimpleNamespace(duplicate=False)


async def test_a_relay_claims_only_its_producers_rows(sessions: async_sessionmaker[AsyncSession]) -> None:
    async with sessions() as session:
        for i, producer in enumerate(["tracker", "planner", "tracker", "analyzer"]):
            await repo.stage_message(session, event_id=f"e{i}", subject=f"{producer}.{i}",
                                     kind="K", payload="{}", producer=producer,
                                     incident_id=None)
        await session.commit()
    js = RecordingJs()
    relay = Outbox(sessions, js, producer="tracker", grace_s=0.0)
    assert await relay.relay_once() == 2
    assert js.subjects == ["tracker.0", "tracker.2"]
    async with sessions() as session:
        assert list(await repo.unsent_ids(session, "planner", limit=10)) == ["e1"]
        assert list(await repo.unsent_ids(session, "analyzer", limit=10)) == ["e3"]
        assert list(await repo.unsent_ids(session, "tracker", limit=10)) == []
