"""Planner: validated incidents in, plans out; the one owner of plans and of what jobs run.

Per validated incident it keeps GREYHOUND's ski-rental escalation (greyhound.core.escalation):
the cumulative loss over the job's iterations (read from the telemetry stream for that job
only, from a little before its slowdown: services.planner.iterations), and when the loss reaches
the next strategy's overhead, that strategy's plan built from the validated culprit
(greyhound.core.plan_build). A plan is proposed; its strategy's policy approves it at once
(automatic) or leaves it to an operator over REST, until it expires; an approved plan is
delivered as the job's next version (services.planner.delivery: the ``plans`` and
``plan_deliveries`` rows, ``Subjects.plan(job)``, ``GET /v1/jobs/{id}/plan``); the job's report
(``POST /v1/jobs/{id}/plan/applied`` -> ``Subjects.plan_report``) moves the plan to applied (the
incident to mitigated) and teaches the escalation what the strategy really cost.

The fault's end takes the plans back (delivered like plans). A tracker recovery that the plan
itself explains (it took effect just before, or the level it left is the pre-plan level) is not
an end: the plan stays, and while it does, a slow GPU is re-validated every ``recheck_s``
(a Suspicion to the validator); a verdict that finds it healthy again reverts the plan.

Every message is staged in the transaction that commits the change it announces (the
transactional outbox, services.common.outbox) and sent after the commit; what a failed send or a
killed process leaves, the outbox relay sends. Consumed events are claimed in the
processed-events ledger, so a redelivery does nothing twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from functools import partial

from sqlalchemy.ext.asyncio import AsyncSession

from greyhound.core import plan_build as build
from greyhound.core.escalation import Apply, Escalation
from greyhound.core.lifecycle import IllegalTransition, advance
from greyhound.core.plan_build import NAMES, STRATEGIES
from greyhound.core.tracked_incident import KINDS, Tracked, level, recovery_is_the_plans
from services.common.bus.client import Consumer
from services.common.bus.contract import DetectionEvent, IncidentEvent, PlanReport, Subjects
from services.common.bus.streams import PLANNER, ConsumerSpec
from services.common.db import repository as repo
from services.common.db.documents import PlanStep, Validation, plan_params
from services.common.db.models import Incident, Plan
from services.common.runtime import ServiceContext, supervise
from services.common.unit_of_work import UnitOfWork
from services.planner.base import IN_FORCE, culprit_of, in_layout
from services.planner.delivery import announce, deliver, job_state, note, take_back
from services.planner.rounds import PlannerRounds
from services.planner.settings import PlannerSettings

log = logging.getLogger(__name__)

Event = IncidentEvent | DetectionEvent | PlanReport


class Planner(PlannerRounds):
    """The planner's message handlers (its periodic round and shared state: rounds, base)."""

    async def consume(self, subject: str, msg: Event) -> None:
        """What the consumer calls: ``handle`` in a unit of work of its own, incident events
        and plan reports claimed in the processed-events ledger (a detection only starts or
        judges a watch, which is done twice harmlessly)."""
        await self.work.per_message(self.handle, claim=PLANNER.durable,
                                    claims=lambda m: not isinstance(m, DetectionEvent)
                                    )(subject, msg)

    async def handle(self, uow: UnitOfWork, subject: str, msg: Event) -> None:
        if isinstance(msg, PlanReport):
            await self._report(uow, msg)
        elif isinstance(msg, DetectionEvent):
            await self._detection(uow, msg)
        elif msg.stage == "validated":
            await self._validated(uow, msg)
        elif msg.stage == "resolved":
            await self._resolved(uow, msg)

    async def _detection(self, uow: UnitOfWork, det: DetectionEvent) -> None:
        job = det.job_id
        if det.kind == "slowdown":
            # A job that declared no layout gets no plan: reading its iterations would be waste.
            if await self._layout(uow.session, job) is None:
                return
            span = max(det.detected_iteration - det.first_iteration + 3, 3) * max(det.after_s, 0.0)
            back = min(self.config.lookback_s, max(span, 1.0))
            self._watch(job, datetime.fromtimestamp(det.detected_ns / 1e9 - back, UTC))
            return
        if det.kind != "recovery":
            return
        async with self._locks[job]:
            mine = [t for t in self.tracked.values() if t.job_id == job and not t.resolved]
            if not mine:
                return
            watch = self.watches.get(job)
            for t in mine:
                plans = [p for p in await repo.plans_of_incidents(uow.session, [t.incident_id])
                         if p.status in IN_FORCE and p.version is not None]
                if not plans:
                    continue
                since = None if watch is None or t.applied_count is None \
                    else watch.series.count - t.applied_count
                under = level(watch.series.since(t.applied_count)) \
                    if watch is not None and t.applied_count is not None else None
                t.recovered_under_plan = recovery_is_the_plans(
                    before_s=det.before_s, preplan_s=t.preplan_s, under_plan_s=under,
                    iterations_since=since, settle=self.config.settle_iterations,
                    unconfirmed=any(p.status == "approved" for p in plans))
                t.dirty = True
                log.info("job %s: recovery %.3fs -> %.3fs is %s (incident %s)", job,
                         det.before_s, det.after_s,
                         "the plan's doing" if t.recovered_under_plan else "the fault's end",
                         t.incident_id)

    async def _validated(self, uow: UnitOfWork, ev: IncidentEvent) -> None:
        async with self._locks[ev.job_id]:
            incident = await repo.get_incident_for_update(uow.session, ev.incident_id)
            if incident is None:
                return
            tracked = self.tracked.get(incident.id)
            validation = incident.evidence.validation
            if tracked is not None and validation is not None:
                if tracked.recheck_id and validation.suspicion == tracked.recheck_id:
                    await self._recheck_result(uow, tracked, incident, validation)
                elif validation.confirmed:
                    tracked.culprit = culprit_of(incident)
                    tracked.dirty = True
                return
            if tracked is not None:
                return
            started = await self._start(uow.session, incident, validation)
        if started is not None:
            # its first loss counts once the escalation it saved is committed
            uow.after_commit(partial(self._observe, ev.job_id))

    async def _start(self, session: AsyncSession, incident: Incident,
                     validation: Validation | None) -> Tracked | None:
        kind = KINDS.get(incident.kind)
        if incident.status == "resolved" or validation is None or not validation.confirmed \
                or kind is None:
            return None  # nothing confirmed to act on (the checks could not reproduce it)
        layout = await self._layout(session, incident.job_id)
        if layout is None:
            log.info("incident %s: job %s declared no layout (PUT /v1/jobs/{id}/layout); "
                     "no plan can be built", incident.id, incident.job_id)
            return None
        culprit = culprit_of(incident)
        if culprit.empty:
            return None
        detection = incident.evidence.detection
        healthy = (detection.before_s or detection.healthy_s or 0.0) if detection else 0.0
        if not healthy > 0:
            return None
        state, _ = await job_state(session, incident.job_id)
        esc = Escalation(kind, healthy, await self._overheads(session, incident.job_id, layout),
                         tolerance=self.config.tolerance, alpha=self.config.alpha,
                         available=build.available(layout, culprit))
        t = Tracked(incident.id, incident.job_id, esc, culprit, gpu_of_rank=state.gpu_of_rank,
                    preplan_s=detection.after_s or None if detection else None)
        watch = self._watch(incident.job_id, incident.opened_at
                            - timedelta(seconds=self.config.lookback_s))
        # the slow iterations since the watch began (at the tracker's slowdown) count too
        t.fed = watch.series.count - len(watch.series.recent)
        self.tracked[incident.id] = t
        await repo.save_escalation(session, t.incident_id, t.job_id, t.state())
        t.dirty = False
        log.info("incident %s (%s): escalation from S1, healthy %.3fs, ladder %s, overheads %s",
                 incident.id, incident.kind, healthy, [s.name for s in esc.ladder],
                 {s.name: round(v, 3) for s, v in esc.overheads.items()})
        return t

    async def _recheck_result(self, uow: UnitOfWork, t: Tracked, incident: Incident,
                              validation: Validation) -> None:
        t.recheck_id = None
        t.last_check_at = time.monotonic()
        if validation.verdict != "transient":
            log.info("incident %s: re-check still finds %s", incident.id, validation.gpus)
            return
        why = "a re-validation found the culprit healthy again: the fault has ended"
        await self._end(uow, t, incident, why)

    async def _observe(self, job: str, _new: list[float] | None = None) -> None:
        """Feed every escalation of the job the iterations it has not seen (the watch calls this
        with each batch; each escalation keeps its own cursor, so none sees one twice)."""
        watch = self.watches.get(job)
        if watch is None:
            return
        async with self._locks[job]:
            for t in list(self.tracked.values()):
                if t.job_id != job:
                    continue  # its cursor counts another job's iterations
                if t.esc.closed or t.incident_id not in self.tracked:
                    t.fed = watch.series.count
                    continue
                times, t.fed = watch.series.since(t.fed), watch.series.count
                t.cursor = watch.cursor
                for s in times:
                    decision = t.esc.observe(s)
                    t.dirty = True
                    if isinstance(decision, Apply):
                        await self._propose(t, decision)

    async def _propose(self, t: Tracked, d: Apply) -> None:
        name = NAMES[d.strategy]
        c = self.config
        async with self.work.unit() as uow:
            session = uow.session
            incident = await repo.get_incident_for_update(session, t.incident_id)
            layout = await self._layout(session, t.job_id)
            if incident is None or layout is None or incident.status == "resolved":
                t.esc.failed(d.strategy)
                uow.discard()
                return
            state, _ = await job_state(session, t.job_id)
            proposal = build.propose(d.strategy, layout, in_layout(t, state, layout), state,
                                     c.plan_costs())
            if proposal is None:
                t.esc.failed(d.strategy)
                log.info("incident %s: %s would change nothing; the ladder moves past it",
                         t.incident_id, name)
                await repo.save_escalation(session, t.incident_id, t.job_id, t.state())
                return
            policy = c.policy(name)
            now = datetime.now(UTC)
            plan = await repo.create_plan(
                session, incident_id=t.incident_id, job_id=t.job_id, strategy=name,
                params=plan_params({**proposal.params, "summary": proposal.summary,
                                    "loss_s": round(d.loss_s, 6),
                                    "overhead_s": round(d.overhead_s, 6), "why": d.reason}),
                policy=policy, expected_gain=proposal.expected_gain,
                expires_at=None if policy == "automatic" else now + timedelta(
                    seconds=c.proposal_ttl_s))
            t.pending_plan = plan.id
            await note(session, incident, "plan_proposed", plan, summary=proposal.summary,
                       loss_s=round(d.loss_s, 6), overhead_s=round(d.overhead_s, 6),
                       policy=policy, expires_at=plan.expires_at.isoformat()
                       if plan.expires_at else None)
            await announce(session, plan, "proposed", note_text=proposal.summary,
                           dashboard=self.ctx.settings.api_public_url)
            log.info("incident %s: proposed %s (%s, loss %.2fs >= overhead %.2fs): %s",
                     t.incident_id, name, policy, d.loss_s, d.overhead_s, proposal.summary)
            if policy == "automatic":
                await repo.decide_plan(session, plan, decision="approve", approver="policy",
                                       comment=f"{name} is automatic (GREYHOUND_PLANNER_"
                                               f"{name}_POLICY)")
                await note(session, incident, "plan_approved", plan, by="policy")
                await announce(session, plan, "approved", by="policy",
                               dashboard=self.ctx.settings.api_public_url)
                msg = await deliver(session, plan, layout, t.esc.overheads.get(d.strategy))
                await uow.stage(Subjects.plan(t.job_id), msg)
            await repo.save_escalation(session, t.incident_id, t.job_id, t.state())
            t.dirty = False

    async def _report(self, uow: UnitOfWork, rep: PlanReport) -> None:
        session = uow.session
        async with self._locks[rep.job_id]:
            sent = await repo.get_delivery(session, rep.job_id, rep.version, for_update=True)
            if sent is None or sent.outcome is not None:
                log.warning("job %s: report on version %d ignored (%s)", rep.job_id, rep.version,
                            "unknown version" if sent is None else "already reported")
                return
            sent.outcome, sent.cost_s, sent.error = rep.outcome, rep.cost_s, rep.error
            sent.reporter, sent.reported_at = rep.reporter or None, datetime.now(UTC)
            plan = (await repo.plans_by_id(session, [sent.plan_id], for_update=True))[sent.plan_id]
            incident = await repo.get_incident_for_update(session, plan.incident_id)
            t = self.tracked.get(plan.incident_id)
            if sent.action == "apply" and plan.status == "approved" and plan.version == rep.version:
                if rep.outcome == "applied":
                    await self._applied(uow, plan, incident, t, rep)
                else:
                    await self._failed(uow, plan, incident, t, rep)
            if t is not None:
                await repo.save_escalation(session, t.incident_id, t.job_id, t.state())
                t.dirty = False

    async def _applied(self, uow: UnitOfWork, plan: Plan, incident: Incident | None,
                       t: Tracked | None, rep: PlanReport) -> None:
        session = uow.session
        repo.move_plan(plan, "apply")
        plan.cost_s = rep.cost_s
        detail = PlanStep(plan_id=plan.id, strategy=plan.strategy, version=plan.version,
                          cost_s=rep.cost_s, summary=plan.params.summary or "")
        if incident is not None:
            stage = "mitigated"
            try:
                advance(incident.status, stage)
            except IllegalTransition:
                stage = "plan_applied"  # localised again meanwhile, or over already
            await repo.add_timeline(session, incident, stage, detail)
            if stage == "mitigated":
                await uow.stage(Subjects.incident(plan.job_id), IncidentEvent(
                    job_id=plan.job_id, incident_id=incident.id, stage="mitigated",
                    kind=incident.kind, severity=incident.severity, summary=incident.summary))
        await announce(session, plan, "applied", note_text=f"cost {rep.cost_s} s",
                       dashboard=self.ctx.settings.api_public_url)
        if t is not None:
            strategy = STRATEGIES[plan.strategy]
            if t.esc.pending is strategy:
                cost = rep.cost_s if rep.cost_s is not None else t.esc.overheads[strategy]
                t.esc.applied(strategy, cost)
            if t.pending_plan == plan.id:
                t.pending_plan = None
            watch = self.watches.get(plan.job_id)
            if watch is not None:
                t.applied_count = watch.series.count
                t.preplan_s = level(watch.series.before(watch.series.count, 8))
            t.last_check_at = time.monotonic()
        log.info("plan %s (%s) applied on job %s as version %s, cost %s s", plan.id,
                 plan.strategy, plan.job_id, plan.version, rep.cost_s)

    async def _failed(self, uow: UnitOfWork, plan: Plan, incident: Incident | None,
                      t: Tracked | None, rep: PlanReport) -> None:
        session = uow.session
        repo.move_plan(plan, "fail", reason=rep.error or "the job could not apply it")
        await note(session, incident, "plan_failed", plan, error=rep.error)
        layout = await self._layout(session, plan.job_id)
        if layout is not None:  # the job's current version must say what it really runs
            others = [p for p in await self._in_force(session, plan.job_id) if p.id != plan.id]
            msg = await take_back(session, plan, layout, others_in_force=others, cost_s=None)
            await uow.stage(Subjects.plan(plan.job_id), msg)
        if t is not None:
            strategy = STRATEGIES[plan.strategy]
            if t.esc.pending is strategy:
                t.esc.failed(strategy)
            if t.pending_plan == plan.id:
                t.pending_plan = None
        log.warning("plan %s (%s) failed on job %s: %s", plan.id, plan.strategy, plan.job_id,
                    rep.error)

    async def _resolved(self, uow: UnitOfWork, ev: IncidentEvent) -> None:
        session = uow.session
        async with self._locks[ev.job_id]:
            incident = await repo.get_incident_for_update(session, ev.incident_id)
            t = self.tracked.get(ev.incident_id)
            if incident is None:
                return
            if t is not None and t.recovered_under_plan:
                t.resolved, t.resolved_at = True, time.monotonic()
                t.esc.recovered()
                await self._withdraw_undelivered(session, incident)
                await repo.save_escalation(session, t.incident_id, t.job_id, t.state())
                log.info("incident %s resolved under its plan: the plan stays in force until "
                         "the fault is found over", incident.id)
            else:
                await self._end(uow, t, incident, "the job recovered: the fault has ended")


async def run_planner(ctx: ServiceContext, stop: asyncio.Event,
                      settings: PlannerSettings | None = None, *,
                      planner: Planner | None = None, spec: ConsumerSpec = PLANNER) -> None:
    """The service: its settings from the environment unless given; ends when ``stop`` is set,
    or raises when its consumer cannot go on (the process exits for its supervisor)."""
    planner = planner or Planner(ctx, settings)
    await planner.restore()
    consumer: Consumer[Event] = Consumer(ctx.js, spec, Event, planner.consume)

    async def ticker() -> None:
        while not stop.is_set():
            try:
                await planner.tick()
            except Exception:  # one failed round must not stop planning; the next one retries
                log.exception("planner tick failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), planner.config.poll_s)

    async def stopper() -> None:
        await stop.wait()
        consumer.stop()

    try:
        await supervise(consumer.run(), ticker(), stopper(), planner.work.relay(stop))
    finally:
        await planner.close()


__all__: Sequence[str] = ("Planner", "run_planner")
