"""Tracker: telemetry in, change points and hangs out.

Adapter only: decode (contract) -> JobTracker / hang watch (pure cores) -> publish DetectionEvent.
It also records which ranks each job has (from agents' hellos), since it is the first service to
hear of a job; without a database (a benchmark, a test) hellos are acknowledged and ignored.

Scale-out by job: with GREYHOUND_TRACKER_PARTITIONS=N (N > 1, the same in every process, since
it shapes the telemetry stream), the stream stores telemetry under subjects whose last token is
``{{partition(N, job)}}`` and the tracker started with GREYHOUND_TRACKER_PARTITION=i binds the
durable consumer ``tracker-p{i}-of-{N}`` filtering partition i only. Every job therefore has one
tracker process at a time, and the N processes share the jobs. N=1 (default) is one tracker on
the plain subjects.

Restart: each job's state (JobTracker.state_dict and the hang monitor's learned times) is saved
to a JetStream object store (TrackerStateStore) every ``persist_every_s`` for jobs that changed,
right after any detection is published, and on shutdown; a job seen for the first time by this
process is loaded from there. Messages are acked when handled, before the periodic save: a crash
(not a shutdown) loses at most ``persist_every_s`` of iterations, which the detector tolerates
(it sees a shorter history, not wrong values), whereas holding acks until the save would need
tens of thousands of unacked messages in flight and redeliver them all after any stall.
Detections are saved at once and carry a deterministic event id, so a replay after a crash is
dropped by JetStream's de-duplication rather than reported twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from statistics import median
from typing import Annotated

import numpy as np
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
from services.common.bus.streams import tracker_spec
from services.common.db import repository as repo
from services.common.runtime import ServiceContext
from services.tracker.settings import TrackerSettings
from services.tracker.state_store import TrackerStateStore

log = logging.getLogger(__name__)

Telemetry = Annotated[AgentHello | IterationBatch | CounterBatch, Field(discriminator="kind")]


def detection_id(job: str, d: JobDetection) -> str:
    """Same decision, same id: a detection replayed after a crash is de-duplicated."""
    key = f"{job}|{d.kind}|{d.change}|{d.first_iteration}|{d.detected_iteration}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


class Tracker:
    def __init__(self, ctx: ServiceContext, *, method: Method = "bocd-v",
                 store: TrackerStateStore | None = None, persist_every_s: float = 5.0,
                 settings: TrackerSettings | None = None) -> None:
        self.ctx = ctx
        self.settings = settings or TrackerSettings()
        self.method: Method = method
        self.store = store
        self.persist_every_s = persist_every_s
        self.jobs: dict[str, JobTracker] = {}
        self.hangs: dict[str, JobHangMonitor] = {}
        self.detections = 0
        self._dirty: set[str] = set()
        self._saved_at = time.monotonic()

    def _new_hang_monitor(self) -> JobHangMonitor:
        s = self.settings
        return JobHangMonitor(floor_s=s.hang_floor_s, multiple=s.hang_multiple)

    async def _job(self, job: str) -> tuple[JobTracker, JobHangMonitor]:
        tracker = self.jobs.get(job)
        if tracker is None:
            state = await self.store.load(job) if self.store is not None else None
            if state is not None and state.get("tracker", {}).get("method") == self.method:
                tracker = JobTracker.from_state(state["tracker"])
                self.hangs.setdefault(job, JobHangMonitor.from_state(state["hangs"]))
                log.info("job %s: resumed detector state (%d ranks, slow=%s)", job,
                         len(tracker.index), tracker.slow)
            else:
                tracker = JobTracker(method=self.method)
            self.jobs[job] = tracker
        mon = self.hangs.get(job)
        if mon is None:
            mon = self.hangs[job] = self._new_hang_monitor()
        return tracker, mon

    async def handle(self, subject: str, msg: AgentHello | IterationBatch | CounterBatch) -> None:
        if isinstance(msg, AgentHello):
            await self._hello(msg)
        elif isinstance(msg, IterationBatch):
            await self._iterations(msg)
        else:
            _, mon = await self._job(msg.job_id)
            mon.observe_counters(msg.sampled_ns / 1e9, {f: getattr(msg, f) for f in COUNTER_FIELDS})
            await self.check_hangs()

    async def tick(self) -> None:
        """Between fetches: hang checks, and the periodic save of jobs that changed."""
        await self.check_hangs()
        if self._dirty and time.monotonic() - self._saved_at >= self.persist_every_s:
            await self.persist()

    async def persist(self, jobs: set[str] | None = None) -> None:
        if self.store is None:
            self._dirty.clear()
            return
        todo = set(self._dirty) if jobs is None else jobs
        for job in sorted(todo):
            tracker = self.jobs.get(job)
            if tracker is None:
                continue
            mon = self.hangs.get(job) or self._new_hang_monitor()
            try:
                await self.store.save(job, {"tracker": tracker.state_dict(),
                                            "hangs": mon.state_dict()})
            except Exception:  # keep detecting; the next save retries
                log.exception("could not save state of job %s", job)
                continue
            self._dirty.discard(job)
        if jobs is None:
            self._saved_at = time.monotonic()

    async def check_hangs(self) -> None:
        now = time.time()
        for job, mon in self.hangs.items():
            findings = mon.check(now)
            if findings:
                await self._emit_hang(job, mon, findings)

    async def _emit_hang(self, job: str, mon: JobHangMonitor, found: list[HangFinding]) -> None:
        """One event per job and check: a hang stalls many communicators at once (the cascade),
        and only the diagnosis over all of them can tell the cause from its symptoms."""
        worst = max(found, key=lambda f: f.stalled_s)
        waiting = sorted({r for f in found for r in f.waiting_ranks})
        bases = {f.basis for f in found}
        basis = bases.pop() if len(bases) == 1 else "mixed"
        event = DetectionEvent(
            job_id=job, kind="hang", ranks=waiting[:256], first_iteration=-1,
            detected_iteration=-1, before_s=0.0, after_s=worst.stalled_s,
            detected_ns=time.time_ns(), comm_id=worst.comm_id, stalled_s=worst.stalled_s,
            threshold_s=worst.threshold_s, method="hang-watch",
            evidence={"counters": mon.rows_for(found),
                      "stalled_comms": [f.comm_id for f in found][:1024],
                      "wait_basis": basis})
        await publish(self.ctx.js, Subjects.detection(job), event)
        self.detections += 1
        where = {"gpu": "pending on the GPU", "host": "inside NCCL (host-only)"}.get(
            basis, "pending on the GPU or inside NCCL")
        log.warning("job %s: %d communicator(s) stalled up to %.1fs (threshold %.1fs); %s: %s",
                    job, len(found), worst.stalled_s, worst.threshold_s, where, waiting[:8])

    async def _hello(self, msg: AgentHello) -> None:
        if self.ctx.sessions is None:
            log.debug("no database: hello of %s on %s not recorded", msg.agent_id, msg.job_id)
            return
        try:
            async with self.ctx.db()() as session:
                await repo.touch_job(session, msg.job_id, world_size=msg.world_size)
                await repo.upsert_ranks(session, msg.job_id, msg.agent_id,
                                        [r.model_dump() for r in msg.ranks])
                await session.commit()
        except OSError as exc:
            raise TransientError(f"database unreachable: {exc}") from exc

    async def _iterations(self, msg: IterationBatch) -> None:
        tracker, mon = await self._job(msg.job_id)
        if not msg.duration_s:
            return
        # A message holds tens of values: sorting the list beats numpy's median call overhead.
        mon.observe_iteration(median(msg.duration_s))
        durations = np.asarray(msg.duration_s, dtype=np.float64)
        self._dirty.add(msg.job_id)
        # The agent keeps each rank's iterations in order within and across batches.
        decisions = tracker.observe_many(msg.rank, durations)
        for decision in decisions:
            await self._emit(msg.job_id, decision)
        if decisions:
            await self.persist({msg.job_id})

    async def _emit(self, job: str, d: JobDetection) -> None:
        """``before_s``/``after_s`` are the levels either side of this change; the evidence says
        which change it is (``onset``, ``further`` slowdown while slow, ``partial`` or ``full``
        recovery) and the job's healthy level, so a second fault reads as one."""
        event = DetectionEvent(
            event_id=detection_id(job, d), job_id=job,
            kind="slowdown" if d.kind == "slowdown" else "recovery",
            ranks=list(d.ranks), first_iteration=d.first_iteration,
            detected_iteration=d.detected_iteration, before_s=d.before_s, after_s=d.after_s,
            detected_ns=time.time_ns(), method=self.method,
            evidence={"change": d.change, "healthy_s": d.healthy_s})
        await publish(self.ctx.js, Subjects.detection(job), event)
        self.detections += 1
        log.info("job %s: %s (%s) %.3fs -> %.3fs, healthy %.3fs (ranks %s)", job, d.kind,
                 d.change, d.before_s, d.after_s, d.healthy_s, list(d.ranks)[:8])


async def run_tracker(ctx: ServiceContext, stop: asyncio.Event) -> None:
    store = await TrackerStateStore(ctx.js).open()
    settings = TrackerSettings()
    tracker = Tracker(ctx, method=settings.detector, store=store, settings=settings)
    consumer: Consumer[AgentHello | IterationBatch | CounterBatch] = Consumer(
        ctx.js, tracker_spec(ctx.settings), Telemetry, tracker.handle)
    task = asyncio.create_task(consumer.run(idle=tracker.tick))
    await stop.wait()
    consumer.stop()
    await task
    await tracker.persist()
