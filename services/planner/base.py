"""The planner's state and what its handlers and periodic rounds share: its messages staged in the
commits that make them (the transactional outbox) and sent after, the job's declared layout and
learned overheads, the iteration watches, and taking an incident's plans back once its fault has
ended (delivered like plans)."""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections import defaultdict
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncSession

from greyhound.core import plan_build as build
from greyhound.core.escalation import Strategy
from greyhound.core.plan_build import STRATEGIES, Culprit, JobState, Layout
from greyhound.core.tracked_incident import Tracked
from services.common.bus.contract import Subjects
from services.common.db import repository as repo
from services.common.db.models import Incident, Plan
from services.common.runtime import ServiceContext
from services.common.unit_of_work import UnitOfWork, Work
from services.planner.delivery import announce, note, take_back
from services.planner.iterations import IterationWatch
from services.planner.settings import PlannerSettings

log = logging.getLogger("services.planner")

IN_FORCE = ("approved", "applied")
WATCH_GRACE_S = 600.0  # a watched job with no validated incident by then is no longer watched


class PlannerBase(abc.ABC):
    def __init__(self, ctx: ServiceContext, settings: PlannerSettings | None = None) -> None:
        self.ctx = ctx
        self.config = settings or PlannerSettings()
        self.tracked: dict[str, Tracked] = {}
        self.watches: dict[str, IterationWatch] = {}
        self._watch_tasks: dict[str, asyncio.Task[None]] = {}
        self._watch_since: dict[str, float] = {}
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._work: Work | None = None
        self._saved_at = time.monotonic()

    @property
    def work(self) -> Work:
        """Made on first use: the context's connections may open after the planner is built.
        Its outbox is ordered: the plans stream keeps each job's last message, so a version
        whose first send failed (or that a killed process left) must go out before the next."""
        if self._work is None:
            self._work = self.ctx.work("planner", ordered=True)
        return self._work

    async def _overheads(self, session: AsyncSession, job: str,
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

    async def _layout(self, session: AsyncSession, job: str) -> Layout | None:
        """The layout the job declared (checked when it was), as the planning cores read it."""
        declared = await repo.job_layout(session, job)
        return None if declared is None else Layout(**declared.model_dump())

    def _watch(self, job: str, since: datetime) -> IterationWatch:
        watch = self.watches.get(job)
        if watch is None:
            watch = self.watches[job] = IterationWatch(self.ctx.js, job, since, self._observe)
            self._watch_tasks[job] = asyncio.create_task(watch.run(), name=f"planner-watch-{job}")
        self._watch_since[job] = time.monotonic()
        return watch

    @abc.abstractmethod
    async def _observe(self, job: str, _new: list[float] | None = None) -> None:
        """Feed the job's escalations the iterations its watch read (the handlers' side)."""

    async def _in_force(self, session: AsyncSession, job: str) -> list[Plan]:
        rows = await repo.list_plans(session, job_id=job, limit=1000)
        return sorted((p for p in rows if p.status in IN_FORCE and p.version is not None),
                      key=lambda p: p.version or 0)

    async def _withdraw_undelivered(self, session: AsyncSession, incident: Incident) -> None:
        for plan in await repo.plans_of_incidents(session, [incident.id]):
            if plan.status == "proposed" or (plan.status == "approved" and plan.version is None):
                repo.move_plan(plan, "withdraw", reason="the fault ended before it took effect")
                await note(session, incident, "plan_withdrawn", plan, reason=plan.reason)

    async def _end(self, uow: UnitOfWork, t: Tracked | None, incident: Incident,
                   why: str) -> None:
        """The fault is over: every plan of the incident goes (those in force are reverted,
        delivered like plans), and its escalation closes."""
        session = uow.session
        await self._withdraw_undelivered(session, incident)
        layout = await self._layout(session, incident.job_id)
        for plan in reversed(await self._in_force(session, incident.job_id)):
            if plan.incident_id != incident.id or layout is None:
                continue
            others = [p for p in await self._in_force(session, incident.job_id) if p.id != plan.id]
            cost = t.esc.overheads.get(STRATEGIES[plan.strategy]) if t is not None else None
            msg = await take_back(session, plan, layout, others_in_force=others, cost_s=cost)
            await uow.stage(Subjects.plan(plan.job_id), msg)
            action, stage = ("revert", "plan_reverted") if plan.status == "applied" \
                else ("withdraw", "plan_withdrawn")
            repo.move_plan(plan, action, reason=why)
            await note(session, incident, stage, plan, reason=why, version=msg.version)
            if action == "revert":
                await announce(session, plan, "reverted", note_text=why,
                               dashboard=self.ctx.settings.api_public_url)
            log.info("plan %s (%s) on job %s: %s as version %d (%s)", plan.id, plan.strategy,
                     plan.job_id, stage.removeprefix("plan_"), msg.version, why)
        if t is not None:
            t.esc.recovered()
            t.resolved = incident.status == "resolved"
            t.recovered_under_plan = False
            await repo.save_escalation(session, t.incident_id, t.job_id, t.state())
            self._forget(t)

    def _forget(self, t: Tracked) -> None:
        self.tracked.pop(t.incident_id, None)
        if not any(o.job_id == t.job_id for o in self.tracked.values()):
            self._watch_since[t.job_id] = time.monotonic() - WATCH_GRACE_S + 30.0


def culprit_of(incident: Incident) -> Culprit:
    """The validated culprit in ranks, with each slow GPU's slowdown from its GEMM time."""
    detection, validation = incident.evidence.detection, incident.evidence.validation
    slowdown = (detection.after_s / detection.before_s if detection and detection.before_s
                and detection.after_s else float(incident.severity))
    return Culprit.from_validation(
        gpu_ranks=[g.rank for g in incident.culprit.gpus],
        link_ranks=[(a, b) for a, b in incident.culprit.link_ranks],
        gemm_s=validation.gemm_s or {} if validation else {}, slowdown=slowdown)


def in_layout(t: Tracked, state: JobState, layout: Layout) -> Culprit:
    """The culprit's ranks where its GPUs are now (a topology plan since moved ranks)."""
    if t.gpu_of_rank == state.gpu_of_rank:
        return t.culprit
    then = JobState(gpu_of_rank=t.gpu_of_rank).gpus(layout)
    now = state.gpus(layout)
    rank_now = {int(g): r for r, g in enumerate(now.tolist())}

    def move(r: int) -> int:
        return rank_now[int(then[r])] if 0 <= r < len(then) else r

    return Culprit({move(r): f for r, f in t.culprit.gpu_ranks.items()},
                   tuple((move(a), move(b)) for a, b in t.culprit.link_ranks), t.culprit.slowdown)
