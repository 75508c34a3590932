"""Tracker: telemetry in, change points and hangs out.

Adapter only: decode (contract) -> JobTracker / hang watch (pure cores) -> publish DetectionEvent.
It also records which ranks each job has (from agents' hellos), since it is the first service to
hear of a job.
"""

from __future__ import annotations

import asyncio
import logging
import time
from statistics import median
from typing import Annotated

from pydantic import Field

from greyhound.core.detector import Method
from greyhound.core.job_hangs import COUNTER_FIELDS, HangFinding, JobHangMonitor
from greyhound.core.job_tracker import JobDetection, JobTracker
from services.common.bus.client import Consumer, TransientError, publish
from services.common.bus.contract import (
    AgentHello,
    CounterBatch,
    DetectionEvent,
    IterationBatch,
    Subjects,
)
from services.common.bus.streams import TRACKER
from services.common.db import repository as repo
from services.common.runtime import ServiceContext

log = logging.getLogger(__name__)

Telemetry = Annotated[AgentHello | IterationBatch | CounterBatch, Field(discriminator="kind")]


class Tracker:
    def __init__(self, ctx: ServiceContext, *, method: Method = "bocd-v") -> None:
        self.ctx = ctx
        self.method: Method = method
        self.jobs: dict[str, JobTracker] = {}
        self.hangs: dict[str, JobHangMonitor] = {}
        self.detections = 0

    def _hang_monitor(self, job: str) -> JobHangMonitor:
        mon = self.hangs.get(job)
        if mon is None:
            s = self.ctx.settings
            mon = self.hangs[job] = JobHangMonitor(floor_s=s.hang_floor_s,
                                                   multiple=s.hang_multiple)
        return mon

    async def handle(self, subject: str, msg: AgentHello | IterationBatch | CounterBatch) -> None:
        if isinstance(msg, AgentHello):
            await self._hello(msg)
        elif isinstance(msg, IterationBatch):
            await self._iterations(msg)
        else:
            self._hang_monitor(msg.job_id).observe_counters(
                msg.sampled_ns / 1e9, {f: getattr(msg, f) for f in COUNTER_FIELDS})
            await self.check_hangs()

    async def check_hangs(self) -> None:
        now = time.time()
        for job, mon in self.hangs.items():
            for finding in mon.check(now):
                await self._emit_hang(job, finding)

    async def _emit_hang(self, job: str, f: HangFinding) -> None:
        event = DetectionEvent(
            job_id=job, kind="hang", ranks=list(f.inflight_ranks), first_iteration=-1,
            detected_iteration=-1, before_s=0.0, after_s=f.stalled_s, detected_ns=time.time_ns(),
            comm_id=f.comm_id, stalled_s=f.stalled_s, threshold_s=f.threshold_s,
            method="hang-watch", evidence={"counters": f.rows})
        await publish(self.ctx.js, Subjects.detection(job), event)
        self.detections += 1
        log.warning("job %s: communicator %x stalled %.1fs (threshold %.1fs); inside NCCL: %s",
                    job, f.comm_id, f.stalled_s, f.threshold_s, list(f.inflight_ranks)[:8])

    async def _hello(self, msg: AgentHello) -> None:
        try:
            async with self.ctx.db()() as session:
                await repo.touch_job(session, msg.job_id, world_size=msg.world_size)
                await repo.upsert_ranks(session, msg.job_id, msg.agent_id,
                                        [r.model_dump() for r in msg.ranks])
                await session.commit()
        except OSError as exc:
            raise TransientError(f"database unreachable: {exc}") from exc

    async def _iterations(self, msg: IterationBatch) -> None:
        tracker = self.jobs.get(msg.job_id)
        if tracker is None:
            tracker = self.jobs[msg.job_id] = JobTracker(method=self.method)
        if msg.duration_s:
            self._hang_monitor(msg.job_id).observe_iteration(median(msg.duration_s))
        # The agent keeps each rank's iterations in order within and across batches.
        for decision in tracker.observe_many(msg.rank, msg.duration_s):
            await self._emit(msg.job_id, decision)

    async def _emit(self, job: str, d: JobDetection) -> None:
        event = DetectionEvent(
            job_id=job, kind="slowdown" if d.kind == "slowdown" else "recovery",
            ranks=list(d.ranks), first_iteration=d.first_iteration,
            detected_iteration=d.detected_iteration, before_s=d.before_s, after_s=d.after_s,
            detected_ns=time.time_ns(), method=self.method)
        await publish(self.ctx.js, Subjects.detection(job), event)
        self.detections += 1
        log.info("job %s: %s %.3fs -> %.3fs (ranks %s)", job, d.kind, d.before_s, d.after_s,
                 list(d.ranks)[:8])


async def run_tracker(ctx: ServiceContext, stop: asyncio.Event) -> None:
    tracker = Tracker(ctx, method=ctx.settings.detector)  # type: ignore[arg-type]
    consumer: Consumer[AgentHello | IterationBatch | CounterBatch] = Consumer(
        ctx.js, TRACKER, Telemetry, tracker.handle)
    task = asyncio.create_task(consumer.run(idle=tracker.check_hangs))
    await stop.wait()
    consumer.stop()
    await task
