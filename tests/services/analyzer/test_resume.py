"""What the analyzer finishes that others left: a localisation its process did not live to
record is run again (and only that one), and a hang incident ends when the hang watch says the
communicators move again."""

from __future__ import annotations

import asyncio
import uuid

from services.analyzer.service import Analyzer
from services.common.bus.contract import DetectionEvent, Subjects
from services.common.db import repository as repo
from services.common.db.documents import AnalyzerNote, Localization
from services.common.runtime import ServiceContext
from tests.conftest import Bus
from tests.services.analyzer.helpers import fed_localizer
from tests.services.common.pipeline import AGENTS, SLOW_RANK, StandInJob


def slowdown(job: str) -> DetectionEvent:
    return DetectionEvent(job_id=job, kind="slowdown", ranks=[0, 1, 2, 3], first_iteration=100,
                          detected_iteration=104, before_s=0.1, after_s=0.15, detected_ns=1,
                          evidence={"change": "onset", "healthy_s": 0.1})


async def test_an_unrecorded_localisation_is_run_again(ctx: ServiceContext, own_bus: Bus) -> None:
    job = f"resume-{uuid.uuid4().hex[:6]}"
    async with ctx.db()() as session:
        await repo.touch_job(session, job)
        for agent, ranks in AGENTS.items():
            await repo.upsert_ranks(session, job, agent, [
                {"rank": r, "host": agent, "node": None, "device": r % 2, "pid": 100 + r}
                for r in ranks])
        await session.commit()
    # the analyzer that opened the incident died before localising it (no localizer here)
    await Analyzer(ctx, ctx.work("analyzer")).consume(Subjects.detection(job), slowdown(job))
    # another job's incident whose localisation ran and found nothing: not run again
    other = f"done-{uuid.uuid4().hex[:6]}"
    await Analyzer(ctx, ctx.work("analyzer")).consume(Subjects.detection(other), slowdown(other))
    async with ctx.db()() as session:
        (inc,) = await repo.list_incidents(session, job_id=other)
        inc = await repo.get_incident_for_update(session, inc.id)
        assert inc is not None
        await repo.add_timeline(session, inc, "detected", AnalyzerNote(
            result="unexplained", by="analyzer", evidence=Localization()))
        await session.commit()

    agents = StandInJob(own_bus, job)
    await agents.start()
    localizer, feed, feeding = fed_localizer(ctx, job)
    analyzer = Analyzer(ctx, localizer.work, localizer)
    try:
        assert await analyzer.resume() == 1  # this job only
        assert await analyzer.resume() == 0  # already running: not started twice
        for _ in range(300):
            if not localizer.tasks:
                break
            await asyncio.sleep(0.05)
        async with ctx.db()() as session:
            (inc,) = await repo.list_incidents(session, job_id=job)
        assert inc.status == "localized" and inc.culprit.ranks == [SLOW_RANK], inc.culprit
        assert agents.actions["set_mode:profile"] == len(AGENTS)
        assert await analyzer.resume() == 0
    finally:
        feed.stop()
        await feeding
        await agents.close()


async def test_a_hang_incident_is_resolved_when_the_hang_is_over(ctx: ServiceContext) -> None:
    job = f"hang-{uuid.uuid4().hex[:6]}"
    analyzer = Analyzer(ctx, ctx.work("analyzer"))
    hang = DetectionEvent(job_id=job, kind="hang", ranks=[0, 1], first_iteration=-1,
                          detected_iteration=-1, before_s=0.1, after_s=70.0, detected_ns=1,
                          comm_id=7, stalled_s=70.0, threshold_s=60.0,
                          method=DetectionEvent.HANG_WATCH)
    over = DetectionEvent(job_id=job, kind="recovery", ranks=[], first_iteration=-1,
                          detected_iteration=-1, before_s=60.0, after_s=0.1, detected_ns=2,
                          comm_id=7, method=DetectionEvent.HANG_WATCH,
                          evidence={"moved_comms": [7]})
    await analyzer.consume(Subjects.detection(job), hang)
    await analyzer.consume(Subjects.detection(job), over)
    await analyzer.consume(Subjects.detection(job), over)  # redelivered: claimed, nothing more
    async with ctx.db()() as session:
        (inc,) = await repo.list_incidents(session, job_id=job)
    assert inc.kind == "hang" and inc.status == "resolved"
    assert [e.stage for e in inc.timeline] == ["detected", "resolved"]
    assert inc.timeline[-1].detail.as_json()["moved_comms"] == [7]
