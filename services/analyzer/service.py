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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncSession

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
from services.common.bus.errors import describe, is_transient
from services.common.bus.streams import ANALYZER
from services.common.db import repository as repo
from services.common.db.models import Incident
from services.common.outbox import Outbox
from services.common.runtime import ServiceContext, supervise

log = logging.getLogger(__name__)

_HANG_PRIORITY = {"hang_not_entered": 0, "hang_inconsistent": 1, "hang_hardware": 2}
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


def _severity(x: float) -> float:
    """Severities as the contract and the incidents table take them: finite, 0..MAX_SECONDS."""
    return min(max(x, 0.0), MAX_SECONDS) if x == x else MAX_SECONDS


class Analyzer:
    def __init__(self, ctx: ServiceContext, localizer: SlowLocalizer | None = None, *,
                 outbox: Outbox | None = None) -> None:
        self.ctx = ctx
        self.localizer = localizer
        self.outbox = outbox or (localizer.outbox if localizer is not None
                                 else Outbox.of(ctx, "analyzer"))
        self._chains: dict[str, asyncio.Task[None]] = {}
        self._chained: dict[str, str] = {}  # job -> incident of its newest localisation

    async def handle(self, subject: str, det: DetectionEvent) -> None:
        """A database failure propagates: the consumer retries what may succeed later."""
        # a hang's GPUs may say why (an Xid): asked before the incident is written, briefly
        # (an agent that cannot answer in 1 s delays the incident by at most 3 s)
        gpus = (await job_gpu_health(self.ctx, det.job_id, timeout_s=1.0)
                if det.kind == "hang" else [])
        done = await self._record(det, gpus)
        await self.outbox.flush([e.event_id for e in [*done.events, *done.suspicions]])
        if done.withdrawn is not None and self.localizer is not None:
            self.localizer.cancel(det.job_id, done.withdrawn)
        if done.localize is not None and self.localizer is not None:
            self._localize(done.localize, det, second=done.second)

    async def resume(self) -> int:
        """Localise again every open incident left ``detected`` without a localisation result
        (the analyzer died while profiling, or a failure stopped it before it recorded what it
        found), unless its job is being profiled now; how many were started."""
        if self.localizer is None:
            return 0
        async with self.ctx.db()() as session:
            rows = await repo.unlocalized_incidents(session, SLOW_KEY)
            await session.commit()
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
        async with self.ctx.db()() as session:
            rows = await repo.open_incidents(session, job, SLOW_KEY)
            await session.commit()
        return KnownCauses.from_culprits((i.id, i.culprit) for i in rows if i.id != exclude)

    async def stop(self) -> None:
        for task in list(self._chains.values()):
            task.cancel()
        await asyncio.gather(*self._chains.values(), return_exceptions=True)

    @staticmethod
    def _classify(det: DetectionEvent) -> tuple[str, float, dict[str, Any], str]:
        """Kind, severity, culprit and summary of a new incident for this detection."""
        if det.kind != "hang":
            summary = (f"job {det.job_id} {det.kind}: iteration {det.before_s:.3f}s -> "
                       f"{det.after_s:.3f}s ({det.slowdown:.2f}x)")
            return det.kind, _severity(det.slowdown), {"ranks": det.ranks[:64]}, summary
        stalled = det.stalled_s or 0.0
        severity = _severity(stalled / det.threshold_s if det.threshold_s else 1.0)
        culprit: dict[str, Any] = {"comm_id": det.comm_id, "ranks": det.ranks[:64]}
        rows = det.evidence.get("counters", {})
        # Cascaded symptoms are already dropped by the diagnosis. Of what is left, a rank that
        # never entered (or entered something else) explains peers stuck in the collective after
        # it, so those causes are named before "all entered, none completes".
        found = diagnose_from_rows(rows, now_ns=det.detected_ns, stalled_s=stalled) if rows else []
        mine = sorted(found, key=lambda d: _HANG_PRIORITY.get(d.kind, len(_HANG_PRIORITY)))
        if not mine:
            return "hang", severity, culprit, (
                f"job {det.job_id}: communicator {det.comm_id} made no progress for "
                f"{stalled:.1f}s (cause not determined)")
        d = mine[0]
        comm = unsigned64(d.comm_id)
        culprit = {"comm_id": comm, "ranks": d.ranks[:64], "seq": d.seq, "op": d.op,
                   "diagnosis": d.evidence,
                   "others": [{"kind": o.kind, "comm_id": unsigned64(o.comm_id), "seq": o.seq,
                               "ranks": o.ranks[:16]} for o in mine[1:16]]}
        return d.kind, severity, culprit, (
            f"job {det.job_id}: {d.kind} on communicator {comm} at {d.op} #{d.seq}; "
            f"ranks {d.ranks[:16]}; stalled {stalled:.1f}s")

    async def _record(self, det: DetectionEvent, gpus: list[dict[str, Any]] | None = None
                      ) -> Recorded:
        change = str(det.evidence.get("change", "onset")) if det.kind != "hang" else None
        detail = {"event_id": det.event_id, "ranks": det.ranks[:64], "method": det.method,
                  "first_iteration": det.first_iteration,
                  "detected_iteration": det.detected_iteration,
                  "before_s": det.before_s, "after_s": det.after_s}
        if change is not None:
            detail.update(change=change, healthy_s=det.evidence.get("healthy_s"))
        if det.kind == "slowdown":
            detail.update(stage=det.stage, suspected_iteration=det.suspected_iteration)
        async with self.ctx.db()() as session:
            if not await repo.claim_event(session, ANALYZER.durable, det.event_id):
                return Recorded()
            await repo.touch_job(session, det.job_id)
            if det.kind == "hang":
                done = await self._hang(session, det, detail, gpus or [])
            elif det.hang_over:
                done = await self._hang_over(session, det, detail)
            else:
                open_ = await repo.open_incidents(session, det.job_id, SLOW_KEY)
                if det.withdrawn:
                    done = await self._withdrawn(session, det, detail, open_)
                elif det.kind == "recovery":
                    done = await self._recovery(session, det, detail, change, open_)
                else:
                    done = await self._slowdown(session, det, detail, change, open_)
            for event in done.events:
                await self.outbox.stage(session, Subjects.incident(det.job_id), event)
            for held in done.suspicions:
                await self.outbox.stage(session, Subjects.suspicion(det.job_id), held)
            await session.commit()
        return done

    async def _hang_over(self, session: AsyncSession, det: DetectionEvent,
                         detail: dict[str, Any]) -> Recorded:
        """The stalled communicators move again: the job's hang incident is over."""
        incident = await repo.find_open_incident(session, det.job_id, "hang")
        if incident is None:
            return Recorded()
        await repo.add_timeline(session, incident, "resolved",
                                {**detail, "comm_id": det.comm_id, "by": "hang-watch",
                                 "moved_comms": det.evidence.get("moved_comms", [])})
        return Recorded([self._event(det, incident, "resolved")])

    async def _hang(self, session: AsyncSession, det: DetectionEvent, detail: dict[str, Any],
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
            incident = await repo.open_incident(
                session, job_id=det.job_id, kind=kind, dedup_key="hang", severity=severity,
                summary=summary, culprit=culprit,
                evidence={"detection": detail, **det.evidence, **extra}, stage_detail=detail)
            stage: IncidentStage = "localized" if kind != "hang" else "detected"
            if stage == "localized":
                await repo.add_timeline(session, incident, "localized", culprit)
        else:
            incident.severity = max(incident.severity, severity)
            await repo.add_timeline(session, incident, "detected", detail)
            stage = "detected"
        return Recorded([self._event(det, incident, stage)])

    async def _slowdown(self, session: AsyncSession, det: DetectionEvent, detail: dict[str, Any],
                        change: str | None, open_: Sequence[Incident]) -> Recorded:
        kind, severity, culprit, summary = self._classify(det)
        suspected, confirmed = _moments(det)
        waiting = _suspected_by(det, open_)
        if confirmed is not None and det.confirms is not None and waiting is not None:
            return await self._confirm(session, det, detail, waiting, severity, confirmed)
        if not open_:
            incident = await repo.open_incident(
                session, job_id=det.job_id, kind=kind, dedup_key=SLOW_KEY, severity=severity,
                summary=summary, culprit=culprit, evidence={"detection": detail},
                stage_detail=detail, suspected=suspected, confirmed=confirmed)
            return Recorded([self._event(det, incident, "detected")], incident.id)
        if change != "further":
            # The same slowdown again (a tracker restart, a re-detection): the oldest one.
            incident = open_[0]
            incident.severity = max(incident.severity, severity)
            await repo.add_timeline(session, incident, "detected", detail)
            return Recorded([self._event(det, incident, "detected")], incident.id)
        others = [i.id for i in open_]
        summary = (f"job {det.job_id} further slowdown while slow: iteration "
                   f"{det.before_s:.3f}s -> {det.after_s:.3f}s ({det.slowdown:.2f}x; "
                   f"open: {', '.join(others)})")
        incident = await repo.open_incident(
            session, job_id=det.job_id, kind=kind,
            dedup_key=f"{SLOW_KEY}+{det.first_iteration}:{det.event_id[:8]}",
            severity=severity, summary=summary, culprit=culprit,
            evidence={"detection": detail, "while_open": others}, stage_detail=detail,
            suspected=suspected, confirmed=confirmed)
        for other in open_:
            await repo.add_timeline(session, other, "detected",
                                    {**detail, "further": incident.id})
        return Recorded([self._event(det, incident, "detected")], incident.id, second=True)

    async def _confirm(self, session: AsyncSession, det: DetectionEvent, detail: dict[str, Any],
                       incident: Incident, severity: float, confirmed: repo.Moment) -> Recorded:
        """The suspected slowdown held: its incident is confirmed, and the validator's
        suspicion, if its localisation has already made one, is sent now."""
        repo.confirm_incident(incident, confirmed)
        incident.severity = max(incident.severity, severity)
        await repo.add_timeline(session, incident, "detected", detail)
        done = Recorded([self._event(det, incident, "detected")])
        held = incident.evidence.get("held_suspicion")
        if held is not None and incident.status != "resolved":
            done.suspicions.append(Suspicion.model_validate(held))
            log.info("incident %s confirmed: its suspicion goes to the validator", incident.id)
        if held is not None:
            incident.evidence = {k: v for k, v in incident.evidence.items()
                                 if k != "held_suspicion"}
        return done

    async def _withdrawn(self, session: AsyncSession, det: DetectionEvent,
                         detail: dict[str, Any], open_: Sequence[Incident]) -> Recorded:
        """The job's level came back before its suspected slowdown held: that incident is
        over, never validated (its profiling is stopped)."""
        incident = _suspected_by(det, open_)
        if incident is None:
            return Recorded()
        await repo.add_timeline(session, incident, "resolved",
                                {**detail, "result": "withdrawn", "by": "tracker"})
        return Recorded([self._event(det, incident, "resolved")], withdrawn=incident.id)

    async def _recovery(self, session: AsyncSession, det: DetectionEvent, detail: dict[str, Any],
                        change: str | None, open_: Sequence[Incident]) -> Recorded:
        if not open_:
            return Recorded()
        if change == "partial":
            steps = [OpenStep(i.id, float(i.evidence.get("detection", {}).get("before_s", 0.0)),
                              float(i.evidence.get("detection", {}).get("after_s", 0.0)))
                     for i in open_]
            ended = ended_by(steps, det.before_s, det.after_s) if len(open_) > 1 else None
            if ended is None:  # one cause eased but the job is still slow: note it
                for incident in open_:
                    await repo.add_timeline(session, incident, "detected", detail)
                return Recorded()
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


def _suspected_by(det: DetectionEvent, open_: Sequence[Incident]) -> Incident | None:
    """The open incident only suspected so far that ``det`` confirms or withdraws: the one its
    suspected event opened (``confirms``), else the newest one only suspected (an incident
    opened before the tracker named its suspicions)."""
    waiting = [i for i in open_ if i.only_suspected]
    named = [i for i in waiting
             if (i.evidence.get("detection") or {}).get("event_id") == det.confirms]
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
    d = inc.evidence.get("detection") or {}
    try:
        return DetectionEvent(
            job_id=inc.job_id, kind="slowdown", ranks=list(d.get("ranks") or [])[:64],
            first_iteration=int(d["first_iteration"]),
            detected_iteration=int(d["detected_iteration"]), before_s=float(d["before_s"]),
            after_s=float(d["after_s"]), detected_ns=time.time_ns(),
            method=str(d.get("method") or "bocd-v"),
            evidence={"change": d.get("change") or "onset",
                      "healthy_s": d.get("healthy_s") or d["before_s"]})
    except (KeyError, TypeError, ValueError, ValidationError):
        return None


async def run_analyzer(ctx: ServiceContext, stop: asyncio.Event) -> None:
    """The service: detections, the collective feed, the outbox relay and the retention pass,
    supervised (one that dies ends the process for its supervisor to restart it)."""
    settings = AnalyzerSettings()
    outbox = Outbox.of(ctx, "analyzer")
    localizer = SlowLocalizer(ctx, outbox=outbox)
    analyzer = Analyzer(ctx, localizer, outbox=outbox)
    consumer: Consumer[DetectionEvent] = Consumer(ctx.js, ANALYZER, DetectionEvent, analyzer.handle)
    feed = CollectiveFeed(ctx.js, localizer.buffers)

    async def stopper() -> None:
        await stop.wait()
        consumer.stop()
        feed.stop()

    async def resumer() -> None:
        """At start-up and every resume_every_s; the database being away is waited out."""
        while not stop.is_set():
            try:
                await analyzer.resume()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                log.warning("resuming localisations failed: %s", describe(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), settings.resume_every_s)

    try:
        await supervise(consumer.run(), feed.run(), outbox.run(stop), stopper(), resumer(),
                        run_retention(ctx.db(), settings, stop,
                                      events_max_age_s=ctx.settings.events_max_age_s))
    finally:
        await analyzer.stop()
        await localizer.stop()
