"""Analyzer: detections in, incidents out.

A slowdown opens (or updates) the job's open slowdown incident; a recovery resolves it. Each
incident change is committed first, then announced on the bus, then the detection is acked.
A slowdown also starts its localisation (``slow.SlowLocalizer``) as a task of its own, fed by
the collectives consumer, so detections keep flowing while a job is profiled.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from services.analyzer.hangs import diagnose_from_rows, unsigned64
from services.analyzer.profiling import CollectiveFeed
from services.analyzer.slow import SlowLocalizer
from services.common.bus.client import Consumer, TransientError, publish
from services.common.bus.contract import DetectionEvent, IncidentEvent, Subjects
from services.common.bus.streams import ANALYZER
from services.common.db import repository as repo
from services.common.runtime import ServiceContext

log = logging.getLogger(__name__)

_HANG_PRIORITY = {"hang_not_entered": 0, "hang_inconsistent": 1, "hang_hardware": 2}


class Analyzer:
    def __init__(self, ctx: ServiceContext, localizer: SlowLocalizer | None = None) -> None:
        self.ctx = ctx
        self.localizer = localizer

    async def handle(self, subject: str, det: DetectionEvent) -> None:
        try:
            announce = await self._record(det)
        except OSError as exc:
            raise TransientError(f"database unreachable: {exc}") from exc
        if announce is None:
            return
        await publish(self.ctx.js, Subjects.incident(det.job_id), announce)
        if det.kind == "slowdown" and self.localizer is not None \
                and announce.stage != "resolved":
            self.localizer.start(announce.incident_id, det)

    @staticmethod
    def _classify(det: DetectionEvent) -> tuple[str, float, dict[str, Any], str]:
        """Kind, severity, culprit and summary of a new incident for this detection."""
        if det.kind != "hang":
            summary = (f"job {det.job_id} {det.kind}: iteration {det.before_s:.3f}s -> "
                       f"{det.after_s:.3f}s ({det.slowdown:.2f}x)")
            return det.kind, det.slowdown, {"ranks": det.ranks[:64]}, summary
        stalled = det.stalled_s or 0.0
        severity = stalled / det.threshold_s if det.threshold_s else 1.0
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

    async def _record(self, det: DetectionEvent) -> IncidentEvent | None:
        detail = {"event_id": det.event_id, "ranks": det.ranks[:64], "method": det.method,
                  "first_iteration": det.first_iteration,
                  "detected_iteration": det.detected_iteration,
                  "before_s": det.before_s, "after_s": det.after_s}
        # One open incident per job and problem family: a hang stalls many communicators at once.
        dedup = "slowdown" if det.kind in ("slowdown", "recovery") else "hang"
        kind, severity, culprit, summary = self._classify(det)
        async with self.ctx.db()() as session:
            if not await repo.claim_event(session, ANALYZER.durable, det.event_id):
                return None
            await repo.touch_job(session, det.job_id)
            incident = await repo.find_open_incident(session, det.job_id, dedup)
            if det.kind == "recovery":
                if incident is None:
                    await session.commit()
                    return None
                await repo.add_timeline(session, incident, "resolved", detail)
                stage = "resolved"
            elif incident is None:
                incident = await repo.open_incident(
                    session, job_id=det.job_id, kind=kind, dedup_key=dedup, severity=severity,
                    summary=summary, culprit=culprit,
                    evidence={"detection": detail, **det.evidence}, stage_detail=detail)
                stage = "localized" if det.kind == "hang" and kind != "hang" else "detected"
                if stage == "localized":
                    await repo.add_timeline(session, incident, "localized", culprit)
            else:
                incident.severity = max(incident.severity, severity)
                await repo.add_timeline(session, incident, "detected", detail)
                stage = "detected"
            await session.commit()
            log.info("incident %s %s (%s)", incident.id, stage, incident.summary)
            return IncidentEvent(job_id=det.job_id, incident_id=incident.id, stage=stage,
                                 kind=incident.kind, severity=incident.severity,
                                 summary=incident.summary)


async def run_analyzer(ctx: ServiceContext, stop: asyncio.Event) -> None:
    localizer = SlowLocalizer(ctx)
    analyzer = Analyzer(ctx, localizer)
    consumer: Consumer[DetectionEvent] = Consumer(ctx.js, ANALYZER, DetectionEvent, analyzer.handle)
    feed = CollectiveFeed(ctx.js, localizer.buffers)
    tasks = [asyncio.create_task(consumer.run()), asyncio.create_task(feed.run())]
    await stop.wait()
    consumer.stop()
    feed.stop()
    await localizer.stop()
    await asyncio.gather(*tasks)
