"""Analyzer: detections in, incidents out.

A slowdown opens (or updates) the job's open slowdown incident; a recovery resolves it. Each
incident change is committed first, then announced on the bus, then the detection is acked.
"""

from __future__ import annotations

import asyncio
import logging

from services.common.bus.client import Consumer, TransientError, publish
from services.common.bus.contract import DetectionEvent, IncidentEvent, Subjects
from services.common.bus.streams import ANALYZER
from services.common.db import repository as repo
from services.common.runtime import ServiceContext

log = logging.getLogger(__name__)


class Analyzer:
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    async def handle(self, subject: str, det: DetectionEvent) -> None:
        try:
            announce = await self._record(det)
        except OSError as exc:
            raise TransientError(f"database unreachable: {exc}") from exc
        if announce is not None:
            await publish(self.ctx.js, Subjects.incident(det.job_id), announce)

    async def _record(self, det: DetectionEvent) -> IncidentEvent | None:
        detail = {"event_id": det.event_id, "ranks": det.ranks[:64], "method": det.method,
                  "first_iteration": det.first_iteration,
                  "detected_iteration": det.detected_iteration,
                  "before_s": det.before_s, "after_s": det.after_s}
        dedup = "slowdown" if det.kind in ("slowdown", "recovery") else f"hang:{det.comm_id}"
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
                summary = (f"job {det.job_id} {det.kind}: iteration {det.before_s:.3f}s -> "
                           f"{det.after_s:.3f}s ({det.slowdown:.2f}x)")
                incident = await repo.open_incident(
                    session, job_id=det.job_id, kind=det.kind, dedup_key=dedup,
                    severity=det.slowdown, summary=summary,
                    culprit={"ranks": det.ranks[:64], "comm_id": det.comm_id},
                    evidence={"detection": detail}, stage_detail=detail)
                stage = "detected"
            else:
                incident.severity = max(incident.severity, det.slowdown)
                await repo.add_timeline(session, incident, "detected", detail)
                stage = "detected"
            await session.commit()
            log.info("incident %s %s (%s)", incident.id, stage, incident.summary)
            return IncidentEvent(job_id=det.job_id, incident_id=incident.id, stage=stage,
                                 kind=incident.kind, severity=incident.severity,
                                 summary=incident.summary)


async def run_analyzer(ctx: ServiceContext, stop: asyncio.Event) -> None:
    analyzer = Analyzer(ctx)
    consumer: Consumer[DetectionEvent] = Consumer(ctx.js, ANALYZER, DetectionEvent, analyzer.handle)
    task = asyncio.create_task(consumer.run())
    await stop.wait()
    consumer.stop()
    await task
