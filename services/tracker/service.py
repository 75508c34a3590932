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

Restart: each job's state (JobTracker.state_dict, the hang monitor's, the stream sequence of the
newest batch observed and the detections not yet handed on) is saved to a JetStream object store
(TrackerStateStore) every ``persist_every_s`` for jobs that changed, right after any detection,
when a job goes idle and on shutdown; a job seen for the first time by this process is loaded
from there, and the batches between its saved sequence and the first one delivered are read
again from the stream (services.tracker.replay), so a crash loses no observation and none is made
twice.

A detection is never lost to a failed publish: it is kept with the job (and in its saved state)
until handed on, retried on every tick, while the batch that caused it is acked once observed.
With a database the hand-over is the transactional outbox (committed, then published by it);
without one, a publish the server acknowledged. Detections carry deterministic event ids, so one
made again (a replay) is stored once.

Memory is bounded: a job without telemetry for ``tracker_idle_evict_s`` is saved and dropped from
memory, communicators not sampled for ``tracker_comm_forget_s`` are forgotten, and a job may have
at most ``tracker_max_ranks`` ranks (a batch bringing more is dead-lettered, nothing observed).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from statistics import median
from typing import Annotated, Any

import numpy as np
from pydantic import Field

from greyhound.core.detector import Method
from greyhound.core.job_hangs import COUNTER_FIELDS, HangFinding, JobHangMonitor
from greyhound.core.job_tracker import JobDetection, JobTracker, TooManyRanks
from greyhound.core.progress import ProgressSample, slow_links
from services.common.bus.bounds import MAX_LISTED, MAX_SECONDS
from services.common.bus.client import Consumer, PermanentError, publish
from services.common.bus.contract import (
    AgentHello,
    CounterBatch,
    DetectionEvent,
    IterationBatch,
    Subjects,
)
from services.common.bus.errors import describe, is_transient
from services.common.bus.streams import ConsumerSpec
from services.common.db import repository as repo
from services.common.runtime import ServiceContext, supervise
from services.tracker.ownership import own_partitions
from services.tracker.replay import STREAM_SEQ, SequencedConsumer, replay
from services.tracker.settings import TrackerSettings
from services.tracker.state_store import TrackerStateStore

log = logging.getLogger(__name__)

Telemetry = Annotated[AgentHello | IterationBatch | CounterBatch, Field(discriminator="kind")]

MIN_LEVEL_S = 1e-6  # a level the contract accepts (> 0) when a job has no iteration time yet
HOUSEKEEPING_S = 1.0


def detection_id(job: str, d: JobDetection) -> str:
    """Same decision, same id: a detection replayed after a crash is de-duplicated."""
    key = f"{job}|{d.kind}|{d.change}|{d.stage}|{d.first_iteration}|{d.detected_iteration}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def _slow_links(mon: JobHangMonitor) -> list[dict[str, Any]]:
    """The links the profiler plugin's latest rates name slow (none without the plugin): a
    slowdown's network cause, found without pausing the job."""
    rows = mon.latest_progress()
    if not rows["rank"]:
        return []
    return [dict(link.evidence()) for link in slow_links(ProgressSample.from_columns(rows))][:64]


def _level(x: float) -> float:
    return min(max(float(x), MIN_LEVEL_S), MAX_SECONDS)


@dataclass
class JobState:
    """What the tracker holds for one job."""

    tracker: JobTracker
    hangs: JobHangMonitor
    seq: int = 0  # stream sequence of the newest iteration batch observed
    batches: int = 0  # iteration batches observed, over the job's life
    pending: list[DetectionEvent] = field(default_factory=list)  # not yet handed on
    seen_at: float = field(default_factory=time.monotonic)
    replayed: bool = False  # the stream was read back from ``seq`` (once, at the first batch)
    suspected_ns: int | None = None  # when the job's pending suspicion was raised
    suspected_event: str | None = None  # and its event id

    def state_dict(self) -> dict[str, Any]:
        return {"tracker": self.tracker.state_dict(), "hangs": self.hangs.state_dict(),
                "seq": self.seq, "batches": self.batches,
                "pending": [e.model_dump(mode="json") for e in self.pending],
                "suspected_ns": self.suspected_ns, "suspected_event": self.suspected_event}


@dataclass
class TrackerStats:
    duplicates: int = 0  # batches at or below a job's saved sequence, delivered again
    replayed: int = 0  # batches read back from the stream after a restart
    handover_failures: int = 0
    evicted: int = 0
    corrupt_states: int = 0


class Tracker:
    def __init__(self, ctx: ServiceContext, *, method: Method = "bocd-v",
                 store: TrackerStateStore | None = None, persist_every_s: float | None = None,
                 settings: TrackerSettings) -> None:
        self.ctx = ctx
        self.settings = settings
        self.method: Method = method
        self.store = store
        self.persist_every_s = persist_every_s or self.settings.tracker_persist_every_s
        # without a database (a benchmark, a test) detections are published as they are
        self.work = ctx.work("tracker") if ctx.sessions is not None else None
        self.state: dict[str, JobState] = {}
        self.detections = 0
        self.stats = TrackerStats()
        self._dirty: set[str] = set()
        self._saved_at = time.monotonic()
        self._housekept_at = time.monotonic()

    @property
    def jobs(self) -> dict[str, JobTracker]:
        return {job: st.tracker for job, st in self.state.items()}

    @property
    def hangs(self) -> dict[str, JobHangMonitor]:
        return {job: st.hangs for job, st in self.state.items()}

    def consumer(self, spec: ConsumerSpec) -> Consumer[Any]:
        """The durable consumer this tracker needs (it reads each message's stream sequence)."""
        return SequencedConsumer(self.ctx.js, spec, Telemetry, self.handle,
                                 ready=self.work.writable if self.work is not None else None)

    def _new_hang_monitor(self) -> JobHangMonitor:
        s = self.settings
        return JobHangMonitor(floor_s=s.hang_floor_s, multiple=s.hang_multiple)

    def _new_tracker(self) -> JobTracker:
        return JobTracker(method=self.method, max_ranks=self.settings.tracker_max_ranks)

    # ---- jobs in memory -----------------------------------------------------------------------

    async def _job(self, job: str, seq: int | None = None) -> JobState:
        st = self.state.get(job)
        if st is None:
            st = await self._load(job)
            self.state[job] = st
        if seq is not None and not st.replayed:
            if self.store is not None:
                await self._replay(job, st, seq)
            st.replayed = True
        st.seen_at = time.monotonic()
        return st

    async def _load(self, job: str) -> JobState:
        """The job's saved state, or a fresh one. A transient failure propagates (the message
        is retried, the job's later ones wait behind it); one no retry can fix (the object
        unreadable, the bus refusing the read) starts the job afresh, since losing the
        detector's history is better than losing every message of the job."""
        try:
            saved = await self.store.load(job) if self.store is not None else None
        except Exception as exc:
            if is_transient(exc):
                raise
            self.stats.corrupt_states += 1
            log.error("job %s: saved state unreadable, starting afresh: %s", job, describe(exc))
            saved = None
        if saved is not None and saved.get("tracker", {}).get("method") == self.method:
            try:
                tracker = JobTracker.from_state(saved["tracker"])
                tracker.max_ranks = self.settings.tracker_max_ranks
                st = JobState(tracker, JobHangMonitor.from_state(saved["hangs"]),
                              seq=int(saved.get("seq", 0)),
                              batches=int(saved.get("batches", 0)),
                              pending=[DetectionEvent.model_validate(e)
                                       for e in saved.get("pending", [])],
                              suspected_ns=saved.get("suspected_ns"),
                              suspected_event=saved.get("suspected_event"))
            except (KeyError, TypeError, ValueError) as exc:
                self.stats.corrupt_states += 1
                log.error("job %s: saved state unusable, starting afresh: %s", job, describe(exc))
            else:
                log.info("job %s: resumed detector state (%d ranks, slow=%s, seq %d, %d "
                         "detection(s) to hand on)", job, len(tracker.index), tracker.slow, st.seq,
                         len(st.pending))
                return st
        return JobState(self._new_tracker(), self._new_hang_monitor())

    async def _replay(self, job: str, st: JobState, upto: int) -> None:
        """Observe the job's batches that its saved state lacks, up to the delivered one. A
        transient failure propagates (the retry goes on from the last batch observed); one no
        retry can fix leaves the gap unobserved and the job tracked from here."""
        n = 0
        try:
            async for seq, batch in replay(self.ctx.js, job, after=st.seq, before=upto,
                                           limit=self.settings.tracker_replay_max_messages):
                self._observe(st, batch, seq)
                n += 1
        except Exception as exc:
            if is_transient(exc):
                raise
            log.error("job %s: could not read back the telemetry its saved state lacks (%d "
                      "batch(es) read); tracking it from here: %s", job, n, describe(exc))
        if n:
            self.stats.replayed += n
            log.info("job %s: replayed %d telemetry batch(es) its saved state did not hold", job, n)

    # ---- messages -----------------------------------------------------------------------------

    async def handle(self, subject: str, msg: AgentHello | IterationBatch | CounterBatch) -> None:
        if isinstance(msg, AgentHello):
            await self._hello(msg)
        elif isinstance(msg, IterationBatch):
            await self._iterations(msg, STREAM_SEQ.get())
        else:
            st = await self._job(msg.job_id)
            st.hangs.observe_counters(msg.sampled_ns / 1e9,
                                      {f: getattr(msg, f) for f in COUNTER_FIELDS},
                                      msg.progress.model_dump() if msg.progress else None)
            self._hang_over(msg.job_id, st)
            await self.check_hangs()
            await self._hand_on(msg.job_id, st)

    async def _hello(self, msg: AgentHello) -> None:
        """Record which agent serves which ranks (the validator pauses them through it). A hello
        that takes a rank another agent announced within ``tracker_rank_takeover_s`` is refused
        (dead-lettered): one node's bus password must not point another job's ranks at itself.
        A database failure propagates: the consumer retries what may succeed later."""
        if self.work is None:
            log.debug("no database: hello of %s on %s not recorded", msg.agent_id, msg.job_id)
            return
        off = set(msg.marks_off)
        since = datetime.now(UTC) - timedelta(seconds=self.settings.tracker_rank_takeover_s)
        async with self.work.unit() as uow:
            held = await repo.ranks_held_by_others(uow.session, msg.job_id, msg.agent_id,
                                                   [r.rank for r in msg.ranks], seen_since=since)
            if held:
                raise PermanentError(
                    f"rank_taken: agent {msg.agent_id} announced rank(s) of job {msg.job_id} "
                    f"that another agent holds ({', '.join(f'{r}: {a}' for r, a in held[:8])}); "
                    "a rank changes agent only once its holder stopped announcing it")
            await repo.touch_job(uow.session, msg.job_id, world_size=msg.world_size)
            await repo.upsert_ranks(uow.session, msg.job_id, msg.agent_id,
                                    [{**r.model_dump(), "marks_off": r.rank in off}
                                     for r in msg.ranks])

    async def _iterations(self, msg: IterationBatch, seq: int | None) -> None:
        st = await self._job(msg.job_id, seq)
        if seq is not None and seq <= st.seq:
            self.stats.duplicates += 1
            return
        try:
            decided = self._observe(st, msg, seq)
        except TooManyRanks as exc:
            raise PermanentError(f"job {msg.job_id}: {exc}") from exc
        if decided:
            await self.persist({msg.job_id})  # the detections are safe before they are sent
            await self._hand_on(msg.job_id, st)

    def _observe(self, st: JobState, msg: IterationBatch, seq: int | None) -> bool:
        """One batch into the job's detectors; True when it made a detection."""
        if seq is not None:
            st.seq = max(st.seq, seq)
        st.batches += 1
        self._dirty.add(msg.job_id)
        if not msg.duration_s:
            return False
        # A message holds tens of values: sorting the list beats numpy's median call overhead.
        st.hangs.observe_iteration(median(msg.duration_s))
        # The agent keeps each rank's iterations in order within and across batches, and counts
        # them: a rank whose numbers go back restarted (the tracker warms it up again).
        decisions = st.tracker.observe_many(msg.rank, np.asarray(msg.duration_s, dtype=np.float64),
                                            msg.iteration)
        for d in decisions:
            st.pending.append(self._detection(msg.job_id, st, d))
        return bool(decisions)

    def _detection(self, job: str, st: JobState, d: JobDetection) -> DetectionEvent:
        """``before_s``/``after_s`` are the levels either side of this change; the evidence says
        which change it is (``onset``, ``further`` slowdown while slow, ``partial`` or ``full``
        recovery, ``withdrawn`` suspicion) and the job's healthy level, so a second fault reads
        as one. A slowdown says its stage and when it was first suspected."""
        self.detections += 1
        now = time.time_ns()
        log.info("job %s: %s (%s%s) %.3fs -> %.3fs, healthy %.3fs (ranks %s)", job, d.kind,
                 d.change, f", {d.stage}" if d.kind == "slowdown" else "", d.before_s,
                 d.after_s, d.healthy_s, list(d.ranks)[:8])
        event_id = detection_id(job, d)
        suspected_ns: int | None = None
        confirms: str | None = None
        if d.kind == "slowdown":
            # a confirmation of an earlier suspicion names it and says when it was; one made
            # at once, that it was now
            later = d.stage == "confirmed" and d.suspected_iteration != d.detected_iteration
            if later and st.suspected_ns is not None:
                suspected_ns, confirms = st.suspected_ns, st.suspected_event
            else:
                suspected_ns = now
            st.suspected_ns, st.suspected_event = ((now, event_id) if d.stage == "suspected"
                                                   else (None, None))
        elif d.change == "withdrawn":
            confirms = st.suspected_event  # what it withdraws
            st.suspected_ns, st.suspected_event = None, None
        return DetectionEvent(
            event_id=event_id, job_id=job, confirms=confirms,
            kind="slowdown" if d.kind == "slowdown" else "recovery",
            ranks=list(d.ranks)[:MAX_LISTED], first_iteration=max(d.first_iteration, -1),
            detected_iteration=max(d.detected_iteration, -1), before_s=_level(d.before_s),
            after_s=_level(d.after_s), detected_ns=now, method=self.method,
            evidence={"change": d.change, "healthy_s": _level(d.healthy_s),
                      "ranks_total": len(d.ranks), "slow_links": _slow_links(st.hangs)},
            stage="suspected" if d.stage == "suspected" else "confirmed",
            suspected_iteration=(max(d.suspected_iteration, -1) if d.kind == "slowdown"
                                 else None),
            suspected_ns=suspected_ns)

    # ---- hangs --------------------------------------------------------------------------------

    async def check_hangs(self) -> None:
        now = time.time()
        for job, st in self.state.items():
            findings = st.hangs.check(now)
            if findings:
                st.pending.append(self._hang_event(job, st.hangs, findings))
                self._dirty.add(job)

    def _hang_event(self, job: str, mon: JobHangMonitor, found: list[HangFinding]
                    ) -> DetectionEvent:
        """One event per job and check: a hang stalls many communicators at once (the cascade),
        and only the diagnosis over all of them can tell the cause from its symptoms."""
        worst = max(found, key=lambda f: f.stalled_s)
        waiting = sorted({r for f in found for r in f.waiting_ranks})
        bases = {f.basis for f in found}
        basis = bases.pop() if len(bases) == 1 else "mixed"
        self.detections += 1
        where = {"gpu": "pending on the GPU", "host": "inside NCCL (host-only)"}.get(
            basis, "pending on the GPU or inside NCCL")
        log.warning("job %s: %d communicator(s) stalled up to %.1fs (threshold %.1fs); %s: %s",
                    job, len(found), worst.stalled_s, worst.threshold_s, where, waiting[:8])
        return DetectionEvent(
            job_id=job, kind="hang", ranks=waiting[:256], first_iteration=-1,
            detected_iteration=-1, before_s=_level(mon.policy.typical_s()),
            after_s=_level(worst.stalled_s), detected_ns=time.time_ns(), comm_id=worst.comm_id,
            stalled_s=min(worst.stalled_s, MAX_SECONDS),
            threshold_s=min(worst.threshold_s, MAX_SECONDS), method=DetectionEvent.HANG_WATCH,
            evidence={"counters": mon.rows_for(found), "progress": mon.progress_for(found),
                      "stalled_comms": [f.comm_id for f in found][:1024],
                      "wait_basis": basis,
                      # members whose GPU view is off (no completion marks): host time only
                      "marks_off_ranks": sorted({r for f in found for r in f.marks_off})[:1024],
                      "in_setup": any(f.setup for f in found)})

    def _hang_over(self, job: str, st: JobState) -> None:
        """Every communicator reported hung moves again: the job's hang is over."""
        moved = st.hangs.take_recovered()
        if not moved or st.hangs.alarmed():
            return
        typical = _level(st.hangs.policy.typical_s())
        log.info("job %s: the stalled communicator(s) %s move again; the hang is over", job,
                 moved[:8])
        st.pending.append(DetectionEvent(
            event_id=uuid.uuid4().hex, job_id=job, kind="recovery", ranks=[],
            first_iteration=-1, detected_iteration=-1,
            before_s=_level(max(st.hangs.policy.threshold_s(), typical)), after_s=typical,
            detected_ns=time.time_ns(), comm_id=moved[0], method=DetectionEvent.HANG_WATCH,
            evidence={"moved_comms": moved[:1024]}))
        self._dirty.add(job)

    # ---- handing detections on ----------------------------------------------------------------

    async def _hand_on(self, job: str, st: JobState) -> None:
        """Pass the job's pending detections on, in order; what fails stays for the next tick."""
        if not st.pending:
            return
        subject = Subjects.detection(job)
        try:
            if self.work is not None:
                async with self.work.unit() as uow:
                    for e in st.pending:
                        await uow.stage(subject, e)
                st.pending.clear()
            else:
                while st.pending:
                    await publish(self.ctx.js, subject, st.pending[0])
                    st.pending.pop(0)
        except Exception as exc:
            self.stats.handover_failures += 1
            if self.stats.handover_failures == 1 or self.stats.handover_failures % 100 == 0:
                log.warning("job %s: %d detection(s) wait to be handed on (%d failure(s) so far): "
                            "%s", job, len(st.pending), self.stats.handover_failures,
                            describe(exc))
        finally:
            self._dirty.add(job)

    # ---- periodic work ------------------------------------------------------------------------

    async def tick(self) -> None:
        """Between fetches: hang checks, pending detections, the periodic save, and (about once
        a second) forgetting what went quiet."""
        await self.check_hangs()
        for job, st in list(self.state.items()):
            if st.pending:
                await self._hand_on(job, st)
        if self._dirty and time.monotonic() - self._saved_at >= self.persist_every_s:
            await self.persist()
        if time.monotonic() - self._housekept_at >= HOUSEKEEPING_S:
            self._housekept_at = time.monotonic()
            await self._housekeeping()

    async def _housekeeping(self) -> None:
        now_wall, now = time.time(), time.monotonic()
        s = self.settings
        for job, st in list(self.state.items()):
            st.hangs.forget(now_wall, s.tracker_comm_forget_s)
            if now - st.seen_at < s.tracker_idle_evict_s or st.pending:
                continue
            if self.store is not None and not await self._save(job, st):
                continue  # kept until it can be saved
            del self.state[job]
            self._dirty.discard(job)
            self.stats.evicted += 1
            log.info("job %s: no telemetry for %.0fs; its state leaves memory", job,
                     now - st.seen_at)

    async def _save(self, job: str, st: JobState) -> bool:
        assert self.store is not None
        try:
            await self.store.save(job, st.state_dict())
        except Exception as exc:  # keep detecting; the next save retries
            log.warning("could not save state of job %s: %s", job, describe(exc))
            return False
        self._dirty.discard(job)
        return True

    async def persist(self, jobs: set[str] | None = None) -> None:
        if self.store is None:
            self._dirty.clear()
            return
        todo = set(self._dirty) if jobs is None else jobs
        for job in sorted(todo):
            st = self.state.get(job)
            if st is not None:
                await self._save(job, st)
        if jobs is None:
            self._saved_at = time.monotonic()

    def forget(self) -> None:
        """Drop every job from memory, unsaved: the partition's lease was lost, and its next
        owner resumes each job from its saved state and the stream."""
        self.state.clear()
        self._dirty.clear()

    async def close(self) -> None:
        """On shutdown: hand on what is pending (best effort) and save every changed job."""
        for job, st in list(self.state.items()):
            if st.pending:
                await self._hand_on(job, st)
        await self.persist()


async def run_tracker(ctx: ServiceContext, stop: asyncio.Event) -> None:
    """The service: the partition whose lease it holds (services.tracker.ownership); raises when
    its consumer or its outbox relay cannot go on (the process exits for its supervisor to
    restart it)."""
    settings = TrackerSettings()
    store = await TrackerStateStore(ctx.js, ttl_s=settings.tracker_state_ttl_s,
                                    replicas=ctx.settings.stream_replicas,
                                    max_bytes=settings.tracker_state_max_bytes).open()
    tracker = Tracker(ctx, method=settings.detector, store=store, settings=settings)
    tasks = [own_partitions(tracker, ctx, settings, stop)]
    if tracker.work is not None:
        tasks.append(tracker.work.relay(stop))
    await supervise(*tasks)
