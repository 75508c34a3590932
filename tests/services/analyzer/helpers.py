"""What the analyzer's service tests share: the stand-in job's two agents registered in Postgres,
and a slow localizer fed from the telemetry stream as the analyzer process feeds it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager

from services.analyzer.profiling import CollectiveFeed, WindowRule
from services.analyzer.service import Analyzer
from services.analyzer.slow import SlowLocalizer
from services.common.bus.contract import AgentHello, RankInfo, Subjects
from services.common.runtime import ServiceContext
from services.tracker.service import Tracker
from services.tracker.settings import TrackerSettings

AGENTS = ("node-a", "node-b")


async def register_ranks(ctx: ServiceContext, job: str, marks_off: Collection[int] = ()) -> None:
    """Ranks 0-3 of ``job``: two per agent, agent i on host i, announced in each agent's hello
    and recorded by the tracker's handler as it records them (``marks_off``: ranks the hellos
    say have no GPU completion marks)."""
    tracker = Tracker(ctx, settings=TrackerSettings())
    for i, agent in enumerate(AGENTS):
        ranks = [RankInfo(rank=r, host=f"host{i}", device=r % 2, pid=100 + r)
                 for r in (2 * i, 2 * i + 1)]
        await tracker.handle(Subjects.hello(job, agent), AgentHello(
            job_id=job, agent_id=agent, host=f"host{i}", ranks=ranks,
            marks_off=[r.rank for r in ranks if r.rank in marks_off]))


def fed_localizer(ctx: ServiceContext, job: str
                  ) -> tuple[SlowLocalizer, CollectiveFeed, asyncio.Task[None]]:
    """A localizer whose windows fill from the collectives, through the analyzer's own durable
    as the analyzer process feeds it (the buffers keep ``job``'s, what other tests left is
    passed over); stop the feed and await the task when done."""
    localizer = SlowLocalizer(ctx, ctx.work("analyzer"), rule=WindowRule(min_rows=16, max_wall_s=8.0))
    feed = CollectiveFeed(ctx.js, localizer.buffers)
    return localizer, feed, asyncio.create_task(feed.run())


@asynccontextmanager
async def fed_analyzer(ctx: ServiceContext, job: str) -> AsyncIterator[Analyzer]:
    """An analyzer over `fed_localizer`, its feed, localisations and tasks stopped at the end."""
    localizer, feed, feeding = fed_localizer(ctx, job)
    analyzer = Analyzer(ctx, localizer.work, localizer)
    try:
        yield analyzer
    finally:
        feed.stop()
        await feeding
        await analyzer.stop()
        await localizer.stop()
