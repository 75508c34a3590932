"""Analyzer: detections in, incidents out.

A slowdown opens (or updates) the job's slowdown incident; a recovery resolves it; a hang opens
the job's hang incident and the end of the hang (its communicators move again) resolves it.
Each incident change and its announcements are committed together (the announcements into the
transactional outbox, services.common.outbox), then sent, then the detection is acked: a crash or
a failed publish anywhere after the commit delays an announcement, never loses it. A slowdown
also starts its localisation (``slow.SlowLocalizer``) as a task of its own, fed by the
collectives consumer, so detections keep flowing while a job is profiled. A localisation that
its process did not live to record is started again when the analyzer starts (``resume``): an
incident still ``detected``, open, with no localisation result.

Two stages (greyhound.core.levels): a slowdown a short transient could explain comes first as
a *suspected* detection. It opens its incident (``suspected_at``) and starts the localisation,
since profiling costs the job little, but the validator's suspicion, which pauses the job, is
held back (kept on the incident) until the tracker's confirmation (``confirmed_at``) and sent
then. A withdrawn suspicion (the level came back first) resolves its incident and stops its
profiling; a slowdown suspected meanwhile waits for that profiling to end rather than be
dropped as a repeat.

A second fault while the first is open is its own incident. When the tracker reports a further
slowdown of a job that is already slow, a new incident opens (the open ones get a timeline entry
that points to it) and the job is profiled again; the localisation names only what the open
incidents do not already name (``known_causes.new_causes``), and closes the new incident as "a
known cause got worse" when nothing new shows. Its own incident rather than a second culprit on
the first one, because the two causes live apart: each is validated on its own hardware, gets its
own mitigation, and ends on its own (the congested link clears while the GPU stays slow). A
partial recovery therefore resolves one incident: the one whose own step best matches the fall
(``known_causes.ended_by``); a full recovery resolves them all. Localisations of one job run one
after the other, since a job is profiled through one window at a time.

Split by job over several processes (``GREYHOUND_TRACKER_PARTITIONS``, services.common
.ownership): each process consumes the detections and the collectives of one partition's jobs
while it holds that partition's lease, so a job's detections keep their order and its
localisation chain and profiling window live in one process. Taking a partition (at start, or
over from a dead owner) it resumes the unfinished localisations of that partition's jobs only;
losing its lease it stops them and forgets them (the next owner resumes them from Postgres).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncSession

from greyhound.core.incident_opening import hang_opening, slowdown_opening
from greyhound.core.known_causes import KnownCauses, OpenStep, ended_by
from greyhound.hookabi import unsigned64
from services.analyzer.gpu_evidence import explain_hang_with_gpus, job_gpu_health
from services.analyzer.hangs import diagnose_from_rows
from services.analyzer.profiling import CollectiveFeed
from services.analyzer.retention import run_retention
from services.analyzer.settings import AnalyzerSettings
from services.analyzer.slow import SlowLocalizer
from services.common.bus.bounds import MAX_SECONDS
from services.common.bus.client import Consumer
from services.common.bus.contract import (
    DetectionEvent,
    IncidentEvent,
    IncidentStage,
    Subjects,
    Suspicion,
)
from services.common.bus.streams import ANALYZER, collectives_spec, partitioned
from services.common.db import exclusion
from services.common.db import repository as repo
from services.common.db.documents import Culprit, Detection, Evidence, OtherHang
from services.common.db.models import Incident
from services.common.ownership import Ownership, Partition, own_partitions
from services.common.patience import periodically
from services.common.runtime import ServiceContext, supervise
from services.common.unit_of_work import UnitOfWork, Work

log = logging.getLogger(__name__)

SLOW_KEY = "slowdown"


@dataclass
class Recorded:
    """What one detection did: the incident events to announce, and the localisation to run
    (incident id, and whether only causes the other open incidents do not name count)."""

    events: list[IncidentEvent] = field(default_factory=list)
    localize: str | None = None
    second: bool = False
    suspicions: list[Suspicion] = field(default_factory=list)  # held back until confirmed
    withdrawn: str | None = None  # the incident whose suspicion was withdrawn
    detection: DetectionEvent | None = None  # what to localise from, when not the one handled


class Analyzer:
    def __init__(self, ctx: ServiceContext, work: Work,
                 localizer: SlowLocalizer | None = None) -> None:
        self.ctx = ctx
        self.work = work
        self.localizer = localizer
        self.part = Partition()  # the jobs this process consumes now
        self._chains: dict[str, asyncio.Task[None]] = {}
        self._chained: dict[str, str] = {}  # job -> incident of its newest localisation
        # what the consumer calls: handle, in a unit of work of its own per detection; one
        # that lost the race to open a job's incident (another detection of the job, in another
        # analyzer, opened it first) runs again and adds to that incident
        # (claimed under the service's one name, whichever partition's durable delivers it)
        self.consume = work.per_message(self.handle, claim=ANALYZER.durable,
                                        race=exclusion.open_incident_taken)

    async def handle(self, uow: UnitOfWork, subject: str, det: DetectionEvent) -> None:
        """One detection, claimed by the consumer's unit of work; a database failure
        propagates: the consumer retries what may succeed later."""
        # a hang's GPUs may say why (an Xid): asked before the incident is written, briefly
        # (an agent that cannot answer in 1 s delays the incident by at most 3 s)
        gpus = (await job_gpu_health(self.ctx.nc, uow.session, det.job_id, timeout_s=1.0)
                if det.kind == "hang" else [])
        done = await self._record(uow.session, det, gpus)
        for event in done.events:
            await uow.stage(Subjects.incident(det.job_id), event)
        for held in done.suspicions:
            await uow.stage(Subjects.suspicion(det.job_id), held)
        withdrawn = done.withdrawn
        if withdrawn is not None and self.localizer is not None:
            localizer = self.localizer

            async def cancel() -> None:
                localizer.cancel(det.job_id, withdrawn)

            uow.after_commit(cancel)
        incident_id = done.localize
        if incident_id is not None and self.localizer is not None:
            source = done.detection or det

            async def localize() -> None:
                self._localize(incident_id, source, second=done.second)

            uow.after_commit(localize)

    async def resume(self) -> int:
        """Localise again every open incident of this partition's jobs left ``detected``
        without a localisation result (the analyzer died while profiling, or a failure stopped
        it before it recorded what it found), unless its job is being profiled now; how many
        were started."""
        if self.localizer is None:
            return 0
        async with self.work.read() as session:
            rows = await repo.unlocalized_incidents(session, SLOW_KEY, jobs=self.part.jobs)
        started = 0
        for inc in rows:
            if inc.job_id in self._chains or inc.job_id in self.localizer.tasks:
                continue
            det = _detection_of(inc)
            if det is None:
                log.warning("incident %s: no usable detection to localise it again", inc.id)
                continue
            log.info("incident %s of job %s: its localisation never finished; starting it again",
                     inc.id, inc.job_id)
            self._localize(inc.id, det, second=inc.dedup_key != SLOW_KEY)
            started += 1
        return started

    def _localize(self, incident_id: str, det: DetectionEvent, *, second: bool) -> None:
        """Queue a localisation behind the job's running one; a repeat of the same incident is
        dropped while one is running or queued, another incident's (a second fault's, or a
        new slowdown's while a withdrawn or closed one is still profiled) waits its turn."""
        assert self.localizer is not None
        localizer = self.localizer
        job = det.job_id
        before = self._chains.get(job) or localizer.tasks.get(job)
        if not second:
            if before is None:
                if localizer.start(incident_id, det):
                    self._chain(job, localizer.tasks[job], incident_id)
                return
            if self._chained.get(job) == incident_id:
                return

        async def run() -> None:
            if before is not None:
                await asyncio.gather(before, return_exceptions=True)
            known = await self._known(job, incident_id) if second else None
            running = localizer.tasks.get(job)
            if running is not None:
                await asyncio.gather(running, return_exceptions=True)
            if localizer.start(incident_id, det, known=known):
                await asyncio.gather(localizer.tasks[job], return_exceptions=True)

        self._chain(job, asyncio.create_task(run(), name=f"localize-chain-{job}"), incident_id)

    def _chain(self, job: str, task: asyncio.Task[None], incident_id: str) -> None:
        self._chains[job] = task
        self._chained[job] = incident_id

        def done(t: asyncio.Task[None]) -> None:
            if self._chains.get(job) is t:
                self._chains.pop(job, None)
                self._chained.pop(job, None)

        task.add_done_callback(done)

    async def _known(self, job: str, exclude: str) -> KnownCauses:
        """What the job's other open slowdown incidents name, read when the localisation runs
        (the first incident's own localisation may have finished only just now)."""
        async with self.work.read() as session:
            rows = await repo.open_incidents(session, job, SLOW_KEY)
        return KnownCauses.from_culprits((i.id, i.culprit) for i in rows if i.id != exclude)

    async def stop(self) -> None:
        for task in list(self._chains.values()):
            task.cancel()
        await asyncio.gather(*self._chains.values(), return_exceptions=True)

    @staticmethod
    def _classify(det: DetectionEvent) -> tuple[str, float, Culprit, str]:
        """Kind, severity, culprit and summary of a new incident for this detection
        (greyhound.core.incident_opening; a hang's counter rows diagnosed first)."""
        if det.kind != "hang":
            o = slowdown_opening(det.job_id, det.kind, det.before_s, det.after_s,
                                 cap=MAX_SECONDS)
            # the plugin's rates may name a network link (greyhound.core.progress)
            links = list(det.evidence.get("slow_links") or [])
            return (o.kind, o.severity, Culprit(ranks=det.ranks[:64], slow_links=links),
                    o.summary)
        stalled = det.stalled_s or 0.0
        rows = det.evidence.get("counters", {})
        found = diagnose_from_rows(rows, now_ns=det.detected_ns, stalled_s=stalled,
                                   progress=det.evidence.get("progress")) if rows else []
        o = hang_opening(det.job_id, det.comm_id, stalled, det.threshold_s, found,
                         cap=MAX_SECONDS)
        d = o.cause
        if d is None:
            return o.kind, o.severity, Culprit(comm_id=det.comm_id, ranks=det.ranks[:64]), o.summary
        culprit = Culprit(comm_id=unsigned64(d.comm_id), ranks=d.ranks[:64], seq=d.seq, op=d.op,
                          diagnosis=d.evidence,
                          others=[OtherHang(kind=x.kind, comm_id=unsigned64(x.comm_id),
                                            seq=x.seq, ranks=x.ranks[:16]) for x in o.others])
        return o.kind, o.severity, culprit, o.summary

    async def _record(self, session: AsyncSession, det: DetectionEvent,
                      gpus: list[dict[str, Any]] | None = None) -> Recorded:
        change = str(det.evidence.get("change", "onset")) if det.kind != "hang" else None
        detail = Detection(event_id=det.event_id, ranks=det.ranks[:64], method=det.method,
                           first_iteration=det.first_iteration,
                           detected_iteration=det.detected_iteration,
                           before_s=det.before_s, after_s=det.after_s)
        if change is not None:
            detail = detail.model_copy(update={"change": change,
                                               "healthy_s": det.evidence.get("healthy_s")})
        if det.kind == "slowdown":
            detail = detail.model_copy(update={"stage": det.stage,
                                               "suspected_iteration": det.suspected_iteration})
        await repo.touch_job(session, det.job_id)
        if det.kind == "hang":
            return await self._hang(session, det, detail, gpus or [])
        if det.hang_over:
            return await self._hang_over(session, det, detail)
        open_ = await repo.open_incidents(session, det.job_id, SLOW_KEY)
        if det.withdrawn:
            return await self._withdrawn(session, det, detail, open_)
        if det.kind == "recovery":
            return await self._recovery(session, det, detail, change, open_)
        return await self._slowdown(session, det, detail, change, open_)

    async def _hang_over(self, session: AsyncSession, det: DetectionEvent,
                         detail: Detection) -> Recorded:
        """The stalled communicators move again: the job's hang incident is over."""
        incident = await repo.find_open_incident(session, det.job_id, "hang")
        if incident is None:
            return Recorded()
        await repo.add_timeline(session, incident, "resolved", detail.model_copy(update={
            "comm_id": det.comm_id, "by": DetectionEvent.HANG_WATCH,
            "moved_comms": list(det.evidence.get("moved_comms", []))}))
        return Recorded([self._event(det, incident, "resolved")])

    async def _hang(self, session: AsyncSession, det: DetectionEvent, detail: Detection,
                    gpus: list[dict[str, Any]]) -> Recorded:
        # One open incident per job and problem family: a hang stalls many communicators at once.
        kind, severity, culprit, summary = self._classify(det)
        incident = await repo.find_open_incident(session, det.job_id, "hang")
        if incident is None:
            kind, culprit, gpu_ev, words = explain_hang_with_gpus(kind, culprit, gpus)
            extra: dict[str, Any] = {"gpu_health": gpu_ev} if gpu_ev is not None else {}
            if words:
                extra["explanation"] = words
                summary = f"{summary}; {words}"
            # the tracker's view of the hang (its counter rows, the stalled communicators...)
            evidence = Evidence.model_validate({"detection": detail, **det.evidence, **extra})
            incident = await repo.open_incident(
                session, job_id=det.job_id, kind=kind, dedup_key="hang", severity=severity,
                summary=summary, culprit=culprit, evidence=evidence, stage_detail=detail)
            opened = [self._event(det, incident, "detected")]
            if kind != "hang":  # named as it opens: announced open, then localised
                await repo.add_timeline(session, incident, "localized", culprit)
                opened.append(self._event(det, incident, "localized"))
            return Recorded(opened)
        incident.severity = max(incident.severity, severity)
        await repo.add_timeline(session, incident, "detected", detail)
        return Recorded([self._event(det, incident, "detected")])

    async def _slowdown(self, session: AsyncSession, det: DetectionEvent, detail: Detection,
                        change: str | None, open_: Sequence[Incident]) -> Recorded:
        kind, severity, culprit, summary = self._classify(det)
        suspected, confirmed = _moments(det)
        waiting = _suspected_by(det, open_)
        if confirmed is not None and det.confirms is not None and waiting is not None:
            return await self._confirm(session, det, detail, waiting, severity, confirmed)
        if not open_:
            incident = await repo.open_incident(
                session, job_id=det.job_id, kind=kind, dedup_key=SLOW_KEY, severity=severity,
                summary=summary, culprit=culprit, evidence=Evidence(detection=detail),
                stage_detail=detail, suspected=suspected, confirmed=confirmed)
            return Recorded([self._event(det, incident, "detected")], incident.id)
        if change != "further":
            # The same slowdown again (a tracker restart, a re-detection): the oldest one.
            incident = open_[0]
            incident.severity = max(incident.severity, severity)
            await repo.add_timeline(session, incident, "detected", detail)
            return Recorded([self._event(det, incident, "detected")], incident.id)
        return await self._further(session, det, detail, open_, kind, severity, culprit)

    async def _further(self, session: AsyncSession, det: DetectionEvent, detail: Detection,
                       open_: Sequence[Incident], kind: str, severity: float,
                       culprit: Culprit, *, what: str = "further slowdown while slow") -> Recorded:
        """A second cause's own incident, localised for what the open ones do not name."""
        suspected, confirmed = _moments(det)
        others = [i.id for i in open_]
        summary = (f"job {det.job_id} {what}: iteration "
                   f"{det.before_s:.3f}s -> {det.after_s:.3f}s ({det.slowdown:.2f}x; "
                   f"open: {', '.join(others)})")
        incident = await repo.open_incident(
            session, job_id=det.job_id, kind=kind,
            dedup_key=f"{SLOW_KEY}+{det.first_iteration}:{det.event_id[:8]}",
            severity=severity, summary=summary, culprit=culprit,
            evidence=Evidence(detection=detail, while_open=others), stage_detail=detail,
            suspected=suspected, confirmed=confirmed)
        for other in open_:
            await repo.add_timeline(session, other, "detected",
                                    detail.model_copy(update={"further": incident.id}))
        return Recorded([self._event(det, incident, "detected")], incident.id, second=True)

    async def _confirm(self, session: AsyncSession, det: DetectionEvent, detail: Detection,
                       incident: Incident, severity: float, confirmed: repo.Moment) -> Recorded:
        """The suspected slowdown held: its incident is confirmed, and the validator's
        suspicion, if its localisation has already made one, is sent now."""
        repo.confirm_incident(incident, confirmed)
        incident.severity = max(incident.severity, severity)
        await repo.add_timeline(session, incident, "detected", detail)
        done = Recorded([self._event(det, incident, "detected")])
        held = incident.evidence.held_suspicion
        if held is not None and incident.status != "resolved":
            done.suspicions.append(held)
            log.info("incident %s confirmed: its suspicion goes to the validator", incident.id)
        if held is not None:
            incident.evidence = incident.evidence.model_copy(update={"held_suspicion": None})
        return done

    async def _withdrawn(self, session: AsyncSession, det: DetectionEvent,
                         detail: Detection, open_: Sequence[Incident]) -> Recorded:
        """The job's level came back before its suspected slowdown held: that incident is
        over, never validated (its profiling is stopped)."""
        incident = _suspected_by(det, open_)
        if incident is None:
            return Recorded()
        await repo.add_timeline(session, incident, "resolved",
                                detail.model_copy(update={"result": "withdrawn",
                                                          "by": "tracker"}))
        return Recorded([self._event(det, incident, "resolved")], withdrawn=incident.id)

    async def _recovery(self, session: AsyncSession, det: DetectionEvent, detail: Detection,
                        change: str | None, open_: Sequence[Incident]) -> Recorded:
        if not open_:
            return Recorded()
        if change == "partial":
            steps = [OpenStep(i.id, d.before_s if (d := i.evidence.detection) else 0.0,
                              d.after_s if d else 0.0) for i in open_]
            ended = ended_by(steps, det.before_s, det.after_s) if len(open_) > 1 else None
            if ended is None:  # one cause eased but the job is still slow: note it
                for incident in open_:
                    await repo.add_timeline(session, incident, "detected", detail)
                rest = unexplained_rest(det, open_)
                if rest is None:
                    return Recorded()
                kind, severity, culprit, _ = self._classify(rest)
                done = await self._further(
                    session, rest, _detail_of(rest, detail), open_, kind, severity, culprit,
                    what="still slow after its plan's recovery")
                done.detection = rest  # localised as the slowdown it is, not the recovery
                return done
            closing = [i for i in open_ if i.id == ended]
        else:
            closing = list(open_)
        for incident in closing:
            await repo.add_timeline(session, incident, "resolved", detail)
        return Recorded([self._event(det, i, "resolved") for i in closing])

    @staticmethod
    def _event(det: DetectionEvent, incident: Incident, stage: IncidentStage) -> IncidentEvent:
        log.info("incident %s %s (%s)", incident.id, stage, incident.summary)
        return IncidentEvent(job_id=det.job_id, incident_id=incident.id, stage=stage,
                             kind=incident.kind, severity=incident.severity,
                             summary=incident.summary)


# A plan's partial recovery that leaves the job above this multiple of its healthy level is not
# the plan's shortfall: S2 moves whole micro-batches (5 where there were 4: at most 1.25x on the
# groups that take more), and S3 puts a congested link's traffic on the pipeline.
UNEXPLAINED_REST = 1.3


def unexplained_rest(det: DetectionEvent, open_: Sequence[Incident]) -> DetectionEvent | None:
    """A partial recovery under a plan that leaves more slowness than the plan can: another
    fault began while the first was being mitigated (a GPU slowed during an S3 pause), hidden
    in the plan's recovery, since the tracker saw one step down and no step up. What is left is
    localised as a further slowdown from the healthy level, for what the open incidents do not
    name already (nothing new closes it as the known cause)."""
    healthy = det.evidence.get("healthy_s")
    if not isinstance(healthy, int | float) or not healthy > 0:
        return None
    if not any(i.status == "mitigated" for i in open_):
        return None
    if det.after_s <= healthy * UNEXPLAINED_REST:
        return None
    return det.model_copy(update={
        "kind": "slowdown", "before_s": float(healthy), "stage": "confirmed", "confirms": None,
        "suspected_iteration": None, "suspected_ns": None,
        "evidence": {**det.evidence, "change": "further", "after_plan": True}})


def _detail_of(rest: DetectionEvent, recovery: Detection) -> Detection:
    return recovery.model_copy(update={"before_s": rest.before_s, "change": "further",
                                       "stage": "confirmed", "suspected_iteration": None})


def _suspected_by(det: DetectionEvent, open_: Sequence[Incident]) -> Incident | None:
    """The open incident only suspected so far that ``det`` confirms or withdraws: the one its
    suspected event opened (``confirms``), else the newest one only suspected (an incident
    opened before the tracker named its suspicions)."""
    waiting = [i for i in open_ if i.only_suspected]
    named = [i for i in waiting
             if i.evidence.detection is not None
             and i.evidence.detection.event_id == det.confirms]
    found = named or waiting
    return found[-1] if found else None


def _moments(det: DetectionEvent) -> tuple[repo.Moment, repo.Moment | None]:
    """A slowdown's suspicion and, when it is confirmed, its confirmation."""
    at = datetime.fromtimestamp(det.detected_ns / 1e9, UTC)
    suspected = repo.Moment(
        datetime.fromtimestamp(det.suspected_ns / 1e9, UTC) if det.suspected_ns else at,
        det.suspected_iteration if det.suspected_iteration is not None
        else det.detected_iteration)
    if det.stage == "suspected":
        return suspected, None
    return suspected, repo.Moment(at, det.detected_iteration)


def _detection_of(inc: Incident) -> DetectionEvent | None:
    """The detection an incident was opened from, rebuilt from what it recorded."""
    d = inc.evidence.detection
    if d is None:
        return None
    try:
        return DetectionEvent(
            job_id=inc.job_id, kind="slowdown", ranks=d.ranks[:64],
            first_iteration=d.first_iteration, detected_iteration=d.detected_iteration,
            before_s=d.before_s, after_s=d.after_s, detected_ns=time.time_ns(),
            method=d.method or "bocd-v",
            evidence={"change": d.change or "onset", "healthy_s": d.healthy_s or d.before_s})
    except ValidationError:
        return None


@dataclass
class AnalyzerOwner:
    """The analyzer as a partition's owner (services.common.ownership): the partition's
    detections and collectives, its unfinished localisations resumed."""

    analyzer: Analyzer
    localizer: SlowLocalizer
    settings: AnalyzerSettings
    consumers: list[Consumer[Any]] = field(default_factory=list)  # the partition's, now

    async def serve(self, part: Partition, stop: asyncio.Event) -> None:
        a, work = self.analyzer, self.analyzer.work
        a.part = part
        consumer: Consumer[DetectionEvent] = Consumer(
            a.ctx.js, partitioned(ANALYZER, part.index, part.count), DetectionEvent, a.consume,
            ready=work.writable, jobs=part.owns)
        feed = CollectiveFeed(a.ctx.js, self.localizer.buffers,
                              spec=collectives_spec(part.index, part.count))
        self.consumers = [consumer, feed]

        async def stopper() -> None:
            await stop.wait()
            consumer.stop()
            feed.stop()

        resumer = periodically(a.resume, self.settings.resume_every_s, stop,
                               what="resuming localisations")
        await supervise(consumer.run(), feed.run(), stopper(), resumer)

    async def forget(self) -> None:
        """Stop the partition's localisations: the next owner starts them again."""
        await self.analyzer.stop()
        await self.localizer.stop()
        self.localizer.buffers.clear()

    async def close(self) -> None:
        await self.forget()  # nothing in memory to save: what is unfinished is resumed


async def run_analyzer(ctx: ServiceContext, stop: asyncio.Event) -> None:
    """The service: the partition whose lease it holds (its detections, collective feed and
    resumed localisations), the outbox relay and the retention pass, supervised (one that dies
    ends the process for its supervisor to restart it)."""
    settings = AnalyzerSettings()
    work = ctx.work("analyzer")
    localizer = SlowLocalizer(ctx, work)
    owner = AnalyzerOwner(Analyzer(ctx, work, localizer), localizer, settings)
    plan = Ownership.of("analyzer", ctx.settings.tracker_partitions, settings.partition,
                        valid_s=settings.lease_valid_s, retry_s=settings.lease_retry_s)
    await supervise(own_partitions(owner, plan, ctx.backends.database_url, stop),
                    work.relay(stop),
                    run_retention(work, settings, stop,
                                  events_max_age_s=ctx.settings.events_max_age_s))
