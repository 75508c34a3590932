"""Two analyzers on one database (issue 21): two hang detections of one job handled at once
give one incident with both detections on it. The loser of the race to open it (the unique
open-incident index refuses its insert once the winner committed) runs its unit of work again
and adds to the winner's incident, rather than dead-lettering its detection."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.analyzer.service import Analyzer
from services.common.bus.contract import DetectionEvent, Subjects
from services.common.db import exclusion
from services.common.db import repository as repo
from services.common.db.models import Incident
from services.common.runtime import ServiceContext
from tests.conftest import Bus


@pytest.fixture()
async def two(own_bus: Bus, fresh_db_url: str
              ) -> AsyncIterator[tuple[ServiceContext, ServiceContext]]:
    async with own_bus.service("analyzer", fresh_db_url) as a, \
            own_bus.service("analyzer", fresh_db_url) as b:
        yield a, b


def _hang(job: str, comm: int) -> DetectionEvent:
    return DetectionEvent(job_id=job, kind="hang", ranks=[0, 1], first_iteration=-1,
                          detected_iteration=-1, before_s=0.1, after_s=70.0, detected_ns=comm,
                          comm_id=comm, stalled_s=70.0, threshold_s=60.0,
                          method=DetectionEvent.HANG_WATCH)


async def _incidents(ctx: ServiceContext, job: str) -> list[Incident]:
    async with ctx.db()() as session:
        return list(await repo.list_incidents(session, job_id=job))


async def _both(a: ServiceContext, b: ServiceContext, job: str) -> None:
    await asyncio.gather(
        Analyzer(a, a.work("analyzer")).consume(Subjects.detection(job), _hang(job, 7)),
        Analyzer(b, b.work("analyzer")).consume(Subjects.detection(job), _hang(job, 8)))


async def test_two_concurrent_hang_detections_give_one_incident(
        two: tuple[ServiceContext, ServiceContext]) -> None:
    a, b = two
    job = f"hang2-{uuid.uuid4().hex[:6]}"
    await _both(a, b, job)
    (inc,) = await _incidents(a, job)
    assert [e.stage for e in inc.timeline] == ["detected", "detected"]


async def test_the_loser_of_the_race_to_open_the_incident_adds_to_it(
        two: tuple[ServiceContext, ServiceContext], monkeypatch: pytest.MonkeyPatch) -> None:
    """The race forced: both detections look for the job's open hang incident before either
    opens one (here the job's row is not locked first, which today happens to serialise two
    detections of a job), so both insert one; the index refuses the second, whose unit runs
    again, finds the first's and adds to it."""
    a, b = two
    job = f"race-{uuid.uuid4().hex[:6]}"
    async with a.db()() as session:
        await repo.touch_job(session, job)
        await session.commit()
    looked, both_looked = 0, asyncio.Event()
    find = repo.find_open_incident
    conflicts: list[bool] = []
    classify = exclusion.open_incident_taken

    async def touch(*_: Any, **__: Any) -> None:
        return None

    async def find_together(session: Any, job_id: str, key: str) -> Incident | None:
        nonlocal looked
        found = await find(session, job_id, key)
        looked += 1
        if looked == 2:
            both_looked.set()
        if looked <= 2:
            await asyncio.wait_for(both_looked.wait(), 30)
        return found

    def taken(exc: BaseException) -> bool:
        conflicts.append(classify(exc))
        return conflicts[-1]

    monkeypatch.setattr(repo, "touch_job", touch)
    monkeypatch.setattr(repo, "find_open_incident", find_together)
    monkeypatch.setattr(exclusion, "open_incident_taken", taken)
    await _both(a, b, job)
    assert conflicts == [True]  # one lost the race, and ran again
    (inc,) = await _incidents(a, job)
    assert inc.kind.startswith("hang")
    assert [e.stage for e in inc.timeline] == ["detected", "detected"]
