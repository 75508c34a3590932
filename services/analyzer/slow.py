"""Localising a slowdown: profile the job for a moment, classify, write the incident, hand on.

One task per job being profiled, so the detection consumer never waits on a window. The task
switches the job's agents to profile mode, lets the collective feed fill the job's buffer until
the window rule is met, switches them back (always, even on error), runs the pure
``localize_slow`` off the event loop, then commits the result to the incident together with
its announcements (a classified ``Suspicion`` for the validator and an ``IncidentEvent``, staged
in the transactional outbox) and sends them. The profile is in memory only, so a database that
is away when the result is recorded is waited out (``record_patience_s``) rather than the
profiling done again; a localisation that its process did not live to record is started again
at the analyzer's next start (``Analyzer.resume``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from greyhound.core.known_causes import KnownCauses, new_causes
from greyhound.core.slow_localization import NodeLabel, SlowLocalization, localize_slow
from greyhound.hookabi import unsigned64
from services.analyzer.gpu_evidence import attach_slow, job_gpu_health
from services.analyzer.profiling import ProfileBuffer, WindowRule
from services.common.bus import control
from services.common.bus.contract import (
    ControlRequest,
    DetectionEvent,
    IncidentEvent,
    Message,
    Subjects,
    Suspicion,
)
from services.common.db import repository as repo
from services.common.db.documents import (
    AnalyzerNote,
    Culprit,
    Evidence,
    Localization,
    LocalizedNote,
)
from services.common.db.models import Rank
from services.common.patience import patiently
from services.common.runtime import ServiceContext
from services.common.unit_of_work import UnitOfWork, Work

log = logging.getLogger(__name__)


class SlowLocalizer:
    """Owns the open profiling windows (``buffers``, shared with the collective feed)."""

    def __init__(self, ctx: ServiceContext, work: Work, *, rule: WindowRule | None = None,
                 control_timeout_s: float = 3.0, record_patience_s: float = 300.0) -> None:
        self.ctx = ctx
        self.work = work
        self.rule = rule or WindowRule()
        self.control_timeout_s = control_timeout_s
        self.record_patience_s = record_patience_s
        self.buffers: dict[str, ProfileBuffer] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.incidents: dict[str, str] = {}  # job -> the incident its running task localises

    def start(self, incident_id: str, det: DetectionEvent, *,
              known: KnownCauses | None = None) -> bool:
        """Begin localising unless this job is already being profiled; False if it is.

        ``known``: what the job's other open incidents name; only the rest is this incident's.
        """
        job = det.job_id
        if job in self.tasks:
            return False
        task = asyncio.create_task(self._run(incident_id, det, known), name=f"localize-{job}")
        self.tasks[job] = task
        self.incidents[job] = incident_id

        def done(_t: asyncio.Task[None]) -> None:
            self.tasks.pop(job, None)
            self.incidents.pop(job, None)

        task.add_done_callback(done)
        return True

    def cancel(self, job: str, incident_id: str) -> None:
        """Stop localising ``incident_id`` (its suspicion was withdrawn): the job goes back to
        monitor mode now rather than at the end of the window."""
        task = self.tasks.get(job)
        if task is not None and self.incidents.get(job) == incident_id:
            log.info("incident %s withdrawn: its profiling stops", incident_id)
            task.cancel()

    async def stop(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    async def _run(self, incident_id: str, det: DetectionEvent,
                   known: KnownCauses | None = None) -> None:
        # GPU health is asked while the job is profiled (and still slow), alongside the window
        gpus = asyncio.create_task(self._gpus(det.job_id), name=f"gpu-health-{det.job_id}")
        try:
            loc, facts = await self._profile(det)
            if known is not None:
                loc = new_causes(loc, known)
            await self._record_patiently(incident_id, det, loc, facts, await gpus)
        except asyncio.CancelledError:
            raise
        except Exception:  # one failed localisation must not take the analyzer down
            log.exception("localisation of job %s failed", det.job_id)
        finally:
            gpus.cancel()

    async def _gpus(self, job: str) -> list[dict[str, Any]]:
        """The job's GPU health now, while it is still slow; [] when it cannot be had."""
        try:
            async with self.work.read() as session:
                return await job_gpu_health(self.ctx.nc, session, job,
                                            timeout_s=self.control_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("GPU health of job %s", job)
            return []

    async def _record_patiently(self, incident_id: str, det: DetectionEvent,
                                loc: SlowLocalization, facts: dict[str, Any],
                                gpus: list[dict[str, Any]]) -> None:
        """Record the result with its announcements, waiting out a database that is away (up
        to record_patience_s): the profile exists only here."""

        async def step(uow: UnitOfWork) -> None:
            for subject, msg in await self._apply(uow.session, incident_id, det, loc, facts,
                                                  gpus):
                await uow.stage(subject, msg)

        await patiently(self.work, step, patience_s=self.record_patience_s,
                        what=f"incident {incident_id}: recording its localisation")

    async def _profile(self, det: DetectionEvent) -> tuple[SlowLocalization, dict[str, Any]]:
        """Profile the job until the window is ready; the localisation, and the facts it rests
        on: the window's, which clock its calls were timed on (GPU, host, or both), and the
        ranks that have no GPU clock to time them on (no completion marks)."""
        async with self.work.read() as session:
            ranks: Sequence[Rank] = await repo.job_ranks(session, det.job_id)
        agents = sorted({r.agent_id for r in ranks})
        node_of_rank: dict[int, NodeLabel] = {
            r.rank: r.node if r.node is not None else r.host for r in ranks}
        buf = ProfileBuffer(det.job_id, frozenset(node_of_rank))
        self.buffers[det.job_id] = buf
        t0 = time.monotonic()
        try:
            answered = await self._set_mode(det.job_id, agents, "profile")
            while not buf.ready(self.rule, iteration_s=det.after_s) \
                    and time.monotonic() - t0 < self.rule.max_wall_s:
                await asyncio.sleep(0.2)
        finally:
            self.buffers.pop(det.job_id, None)
            await self._set_mode(det.job_id, agents, "monitor")
        window = {"agents": len(agents), "agents_answered": answered, "batches": buf.batches,
                  "rows": len(buf), "wall_s": round(time.monotonic() - t0, 3)}
        calls, timeline = buf.window()
        loc = await asyncio.to_thread(localize_slow, calls, node_of_rank=node_of_rank,
                                      before_s=det.before_s, after_s=det.after_s)
        return loc, {"window": window, "timing": timeline.summary(),
                     "marks_off_ranks": sorted(r.rank for r in ranks if r.marks_off)}

    async def _set_mode(self, job: str, agents: list[str], mode: str) -> int:
        """Ask every agent; an agent that does not answer costs its ranks' rows, not the window."""
        req = ControlRequest(job_id=job, action="set_mode",
                             mode="profile" if mode == "profile" else "monitor",
                             timeout_s=self.control_timeout_s)
        replies = await asyncio.gather(*(control.request(self.ctx.nc, a, req) for a in agents),
                                       return_exceptions=True)
        ok = 0
        for agent, reply in zip(agents, replies, strict=True):
            if isinstance(reply, BaseException):
                log.warning("set_mode %s for job %s: agent %s: %s", mode, job, agent, reply)
            elif not reply.ok:
                log.warning("set_mode %s for job %s refused by %s: %s", mode, job, agent,
                            reply.error)
            else:
                ok += 1
        return ok

    async def _apply(self, session: AsyncSession, incident_id: str, det: DetectionEvent,
                     loc: SlowLocalization, facts: dict[str, Any],
                     gpus: list[dict[str, Any]]) -> list[tuple[str, Message]]:
        evidence = Localization.model_validate({**_unsigned_evidence(loc.evidence), **facts})
        incident = await repo.get_incident_for_update(session, incident_id)
        if incident is None:
            return []
        if loc.kind == "none":
            known_only = bool(evidence.known_only)
            stage = ("resolved" if (loc.transient or known_only)
                     and incident.status != "resolved" else None)
            result = ("known cause" if known_only else "transient" if loc.transient
                      else "unexplained")
            await repo.add_timeline(session, incident, stage or "detected",
                                    AnalyzerNote(result=result, by="analyzer", evidence=evidence))
            log.info("incident %s: profiling found nothing (%s)", incident.id, result)
            if stage is None:
                return []
            why = ("no new cause: an open incident's cause got worse" if known_only
                   else "transient: over before it was localised")
            return [(Subjects.incident(det.job_id), IncidentEvent(
                job_id=det.job_id, incident_id=incident.id, stage="resolved",
                kind=incident.kind, severity=incident.severity,
                summary=f"{incident.summary} ({why})"))]
        culprit = _merge_culprit(incident.culprit, loc)
        incident.kind = loc.kind
        incident.culprit = culprit
        incident.evidence = incident.evidence.merged(Evidence(localization=evidence))
        incident.summary = _summary(det, loc, culprit)
        words = attach_slow(incident, loc.compute_ranks, gpus)
        if words:
            incident.summary = f"{incident.summary}; {words}"
        # the slowdown may have ended while profiling: then the lifecycle keeps it closed
        resolved = await repo.add_timeline(
            session, incident, "localized",
            LocalizedNote(kind=loc.kind, culprit=culprit, evidence=evidence)) == "resolved"
        log.info("incident %s localized: %s", incident.id, incident.summary)
        out: list[tuple[str, Message]] = []
        if not resolved:
            suspicion = Suspicion(
                job_id=det.job_id, incident_id=incident.id, kind=loc.kind,
                ranks=loc.compute_ranks, comm_ids=[unsigned64(c) for c in loc.comm_ids],
                slow_groups=[unsigned64(c) for c in loc.slow_groups],
                evidence={"nodes": loc.nodes, "links": [list(p) for p in loc.links],
                          **evidence.as_json()})
            if incident.only_suspected:
                # a validation pauses the job: not before the slowdown is confirmed (the
                # analyzer sends this then, or never if it is withdrawn)
                incident.evidence = incident.evidence.merged(Evidence(held_suspicion=suspicion))
                log.info("incident %s localized while only suspected: the validation waits "
                         "for its confirmation", incident.id)
            else:
                out.append((Subjects.suspicion(det.job_id), suspicion))
        out.append((Subjects.incident(det.job_id), IncidentEvent(
            job_id=det.job_id, incident_id=incident.id, stage="localized", kind=loc.kind,
            severity=incident.severity, summary=incident.summary)))
        return out


def _merge_culprit(old: Culprit, loc: SlowLocalization) -> Culprit:
    """A repeated localisation of the same open incident adds to what it named before (the
    detection's culprit, never localised, names nothing to keep)."""
    prior = old if "comm_ids" in old.model_fields_set else Culprit()

    def union(before: Sequence[Any], new: Sequence[Any]) -> list[Any]:
        seen = {_key(x): x for x in [*before, *new]}
        return [seen[k] for k in sorted(seen)][:256]

    return Culprit(ranks=union(prior.ranks, loc.ranks),
                   compute_ranks=union(prior.compute_ranks, loc.compute_ranks),
                   comm_ids=union(prior.comm_ids, [unsigned64(c) for c in loc.comm_ids]),
                   nodes=union(prior.nodes, loc.nodes),
                   links=union(prior.links, [tuple(p) for p in loc.links]))


def _key(x: Any) -> str:
    return repr(x) if not isinstance(x, int) else f"{x:024d}"


def _summary(det: DetectionEvent, loc: SlowLocalization, culprit: Culprit) -> str:
    what = {"compute_slow": "compute straggler", "comm_slow": "slow communication",
            "mixed_slow": "compute and communication"}.get(loc.kind, loc.kind)
    parts = [f"job {det.job_id} {what} ({det.slowdown:.2f}x)"]
    if loc.compute_ranks:
        parts.append(f"ranks {loc.compute_ranks[:16]}")
    if loc.comm_ids:
        parts.append(f"{len(loc.comm_ids)} communicator(s)")
    if culprit.links:
        parts.append(f"links {culprit.links[:4]}")
    elif culprit.nodes:
        parts.append(f"nodes {culprit.nodes[:8]}")
    return "; ".join(parts)


def _unsigned_evidence(ev: dict[str, Any]) -> dict[str, Any]:
    """Comm ids in the evidence as the unsigned hashes every other record uses."""
    out = dict(ev)
    for key in ("comms", "groups", "by_elimination"):
        if key in out:
            out[key] = [{**e, "comm_id": unsigned64(int(e["comm_id"]))} for e in out[key]]
    return out
