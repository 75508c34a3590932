"""The planner's message handlers, one per kind of message, each over the planner's state and the
message's unit of work (services.common.unit_of_work): load, decide, persist, stage.

* a slowdown starts reading the job's iterations (when it declared a layout); a recovery is
  judged the plan's doing or the fault's end (greyhound.core.tracked_incident);
* a validated incident starts its escalation, or answers a re-check;
* a job's report on a delivery moves the plan to applied (the incident to mitigated) or failed,
  and teaches the escalation what the strategy cost;
* a resolved incident ends its escalation, unless it recovered under its plan, which then stays
  in force until the fault is found over.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from functools import partial

from greyhound.core.lifecycle import IllegalTransition, advance
from greyhound.core.plan_build import STRATEGIES
from greyhound.core.tracked_incident import (
    KINDS,
    Tracked,
    another_fault_ended,
    level,
    recovery_is_the_plans,
)
from services.common.bus.contract import DetectionEvent, IncidentEvent, PlanReport, Subjects
from services.common.db import repository as repo
from services.common.db.documents import PlanStep, Validation
from services.common.db.models import Incident, Plan
from services.common.unit_of_work import UnitOfWork
from services.planner import escalations
from services.planner.delivery import announce, note, take_back
from services.planner.iterations import onset_lead_s
from services.planner.state import PlannerState

log = logging.getLogger(__name__)


async def detection(st: PlannerState, uow: UnitOfWork, det: DetectionEvent) -> None:
    job = det.job_id
    if det.kind == "slowdown":
        # A job that declared no layout gets no plan: reading its iterations would be waste.
        if await st.layout(uow.session, job) is None:
            return
        back = onset_lead_s(det.first_iteration, det.detected_iteration, det.after_s,
                            st.config.lookback_s)
        st.watches.watch(job, datetime.fromtimestamp(det.detected_ns / 1e9 - back, UTC))
        return
    if det.kind != "recovery":
        return
    async with st.locks[job]:
        mine = [t for t in st.of_job(job) if not t.resolved]
        watch = st.watches.of.get(job)
        for t in mine:
            plans = [p for p in await repo.plans_of_incidents(uow.session, [t.incident_id])
                     if p.status in escalations.IN_FORCE and p.version is not None]
            if not plans:
                continue
            since = None if watch is None or t.applied_count is None \
                else watch.series.count - t.applied_count
            under = level(watch.series.since(t.applied_count)) \
                if watch is not None and t.applied_count is not None else None
            judged = recovery_is_the_plans(
                before_s=det.before_s, preplan_s=t.preplan_s, under_plan_s=under,
                iterations_since=since, settle=st.config.settle_iterations,
                unconfirmed=any(p.status == "approved" for p in plans))
            if not judged and t.recovered_under_plan and not t.checkable:
                judged = await others_end(uow, t, plans, det.before_s)
            t.recovered_under_plan = judged
            t.dirty = True
            log.info("job %s: recovery %.3fs -> %.3fs is %s (incident %s)", job,
                     det.before_s, det.after_s,
                     "the plan's doing" if t.recovered_under_plan else "the fault's end",
                     t.incident_id)


async def others_end(uow: UnitOfWork, t: Tracked, plans: list[Plan], before_s: float) -> bool:
    """Whether a recovery under a link's plan, after that plan brought the job back, is the end
    of another fault found since (one that began during the plan's pause hides in the plan's
    recovery until the analyzer localises what was left): then the link's plan stays. Nothing
    re-checks a link, so taking its plan back on another fault's end brings the congestion
    back for as long as ski rental takes to pay for the plan again."""
    since = min((p.applied_at for p in plans if p.applied_at is not None), default=None)
    if since is None:
        return False
    found = await repo.list_incidents(uow.session, job_id=t.job_id, opened_after=since)
    risen = [i.evidence.detection.after_s for i in found
             if i.id != t.incident_id and i.kind in KINDS and i.evidence.detection is not None]
    return another_fault_ended(before_s, risen)


async def validated(st: PlannerState, uow: UnitOfWork, ev: IncidentEvent) -> None:
    async with st.locks[ev.job_id]:
        incident = await repo.get_incident_for_update(uow.session, ev.incident_id)
        if incident is None:
            return
        tracked = st.tracked.get(incident.id)
        validation = incident.evidence.validation
        if tracked is not None:
            if validation is None:
                return
            if tracked.recheck_id and validation.suspicion == tracked.recheck_id:
                await recheck_result(st, uow, tracked, incident, validation)
            elif validation.confirmed:
                tracked.culprit = escalations.culprit_of(incident)
                tracked.dirty = True
            return
        started = await escalations.start(st, uow.session, incident, validation)
    if started is not None:
        # its first loss counts once the escalation it saved is committed
        uow.after_commit(partial(escalations.observe, st, ev.job_id))


async def recheck_result(st: PlannerState, uow: UnitOfWork, t: Tracked, incident: Incident,
                         validation: Validation) -> None:
    t.recheck_id = None
    t.last_check_at = time.monotonic()
    if validation.verdict != "transient":
        log.info("incident %s: re-check still finds %s", incident.id, validation.gpus)
        return
    why = "a re-validation found the culprit healthy again: the fault has ended"
    await escalations.end(st, uow, t, incident, why)


async def report(st: PlannerState, uow: UnitOfWork, rep: PlanReport) -> None:
    session = uow.session
    async with st.locks[rep.job_id]:
        sent = await repo.get_delivery(session, rep.job_id, rep.version, for_update=True)
        if sent is None or sent.outcome is not None:
            log.warning("job %s: report on version %d ignored (%s)", rep.job_id, rep.version,
                        "unknown version" if sent is None else "already reported")
            return
        sent.outcome, sent.cost_s, sent.error = rep.outcome, rep.cost_s, rep.error
        sent.reporter, sent.reported_at = rep.reporter or None, datetime.now(UTC)
        plan = (await repo.plans_by_id(session, [sent.plan_id], for_update=True))[sent.plan_id]
        incident = await repo.get_incident_for_update(session, plan.incident_id)
        t = st.tracked.get(plan.incident_id)
        if sent.action == "apply" and plan.status == "approved" and plan.version == rep.version:
            if rep.outcome == "applied":
                await applied(st, uow, plan, incident, t, rep)
            else:
                await failed(st, uow, plan, incident, t, rep)
        if t is not None:
            await repo.save_escalation(session, t.incident_id, t.job_id, t.state())
            t.dirty = False


async def applied(st: PlannerState, uow: UnitOfWork, plan: Plan, incident: Incident | None,
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
                   dashboard=st.ctx.settings.api_public_url)
    if t is not None:
        strategy = STRATEGIES[plan.strategy]
        if t.esc.pending is strategy:
            cost = rep.cost_s if rep.cost_s is not None else t.esc.overheads[strategy]
            t.esc.applied(strategy, cost)
        if t.pending_plan == plan.id:
            t.pending_plan = None
        watch = st.watches.of.get(plan.job_id)
        if watch is not None:
            t.applied_count = watch.series.count
            t.preplan_s = level(watch.series.before(watch.series.count, 8))
        t.last_check_at = time.monotonic()
    log.info("plan %s (%s) applied on job %s as version %s, cost %s s", plan.id,
             plan.strategy, plan.job_id, plan.version, rep.cost_s)


async def failed(st: PlannerState, uow: UnitOfWork, plan: Plan, incident: Incident | None,
                 t: Tracked | None, rep: PlanReport) -> None:
    session = uow.session
    repo.move_plan(plan, "fail", reason=rep.error or "the job could not apply it")
    await note(session, incident, "plan_failed", plan, error=rep.error)
    layout = await st.layout(session, plan.job_id)
    if layout is not None:  # the job's current version must say what it really runs
        others = [p for p in await escalations.in_force(session, plan.job_id) if p.id != plan.id]
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


async def resolved(st: PlannerState, uow: UnitOfWork, ev: IncidentEvent) -> None:
    session = uow.session
    async with st.locks[ev.job_id]:
        incident = await repo.get_incident_for_update(session, ev.incident_id)
        t = st.tracked.get(ev.incident_id)
        if incident is None:
            return
        if t is not None and t.recovered_under_plan:
            t.resolved, t.resolved_at = True, time.monotonic()
            t.esc.recovered()
            await escalations.withdraw_undelivered(session, incident)
            await repo.save_escalation(session, t.incident_id, t.job_id, t.state())
            log.info("incident %s resolved under its plan: the plan stays in force until "
                     "the fault is found over", incident.id)
        else:
            await escalations.end(st, uow, t, incident, "the job recovered: the fault has ended")
