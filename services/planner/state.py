"""The planner's state, in one object that its handlers (services.planner.handlers), its
escalations (services.planner.escalations) and its periodic round (services.planner.rounds)
are functions over: its connections and units of work, the escalation of every incident it
tracks, the jobs' iteration watches and a lock per job (the consumer, the watches and the round
all change a job's escalations), all of the jobs of the partition it owns (``part``: with
several planners, services.common.ownership).

Its units of work announce through an ordered outbox: the plans stream keeps each job's last
message, so a version whose first send failed (or that a killed process left) must go out
before the next one, and no planner's relay sends a version after a later one of the job went
(plan messages are latest-only: services.common.outbox).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncSession

from greyhound.core import plan_build as build
from greyhound.core.escalation import Strategy
from greyhound.core.plan_build import STRATEGIES, Layout
from greyhound.core.tracked_incident import Tracked
from services.common.bus.contract import PlanMessage
from services.common.db import repository as repo
from services.common.ownership import Partition
from services.common.runtime import ServiceContext
from services.common.unit_of_work import Work
from services.planner.iterations import OnTimes, Watches
from services.planner.settings import PlannerSettings


@dataclass
class PlannerState:
    ctx: ServiceContext
    config: PlannerSettings
    work: Work
    watches: Watches
    tracked: dict[str, Tracked] = field(default_factory=dict)
    locks: defaultdict[str, asyncio.Lock] = field(
        default_factory=lambda: defaultdict(asyncio.Lock))
    saved_at: float = field(default_factory=time.monotonic)  # escalations last saved
    part: Partition = field(default_factory=Partition)  # the jobs this process plans for now

    @classmethod
    def of(cls, ctx: ServiceContext, config: PlannerSettings, on_times: OnTimes
           ) -> PlannerState:
        """On a started service's connections; each watch feeds ``on_times``."""
        work = ctx.work("planner", ordered=True, latest_only=frozenset({PlanMessage.__name__}))
        return cls(ctx, config, work, Watches(ctx.js, on_times))

    def of_job(self, job: str) -> list[Tracked]:
        return [t for t in self.tracked.values() if t.job_id == job]

    def owns(self, job: str) -> bool:
        return self.part.owns(job)

    async def drop_all(self) -> None:
        """The partition's lease was lost: every escalation leaves memory unsaved (the next
        owner restores them from where they were last saved) and every watch ends."""
        self.tracked.clear()
        self.locks.clear()
        await self.watches.close()

    def forget(self, t: Tracked) -> None:
        """``t`` escalates no more; its job's watch ends once no escalation of it is left."""
        self.tracked.pop(t.incident_id, None)
        if not self.of_job(t.job_id):
            self.watches.release(t.job_id)

    async def layout(self, session: AsyncSession, job: str) -> Layout | None:
        """The layout the job declared (checked when it was), as the planning cores read it."""
        declared = await repo.job_layout(session, job)
        return None if declared is None else Layout(**declared.model_dump())

    async def overheads(self, session: AsyncSession, job: str,
                        layout: Layout) -> dict[Strategy, float]:
        """Settings first, then every cost this job reported, oldest first (the same moving
        average the escalation applies within an incident)."""
        c = self.config
        out = {Strategy.MICROBATCH: c.s2_overhead_s, Strategy.TOPOLOGY: c.s3_overhead_s,
               Strategy.RESTART: build.restart_overhead(layout, c.plan_costs())}
        for name, cost in await repo.learned_costs(session, job):
            s = STRATEGIES.get(name)
            if s is not None:
                out[s] += c.alpha * (cost - out[s])
        return out
