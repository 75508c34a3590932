"""An incident's escalation over the planner's state: started once the validator confirmed its
culprit, fed the job's iterations by the job's watch, proposing a plan when the loss reaches the
next strategy's overhead (greyhound.core.escalation), and ended with every plan of the incident
taken back (delivered like plans) when its fault is over. The handlers and the periodic round
both call these, each in a unit of work of its own (services.common.unit_of_work).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncSession

from greyhound.core import plan_build as build
from greyhound.core.escalation import Apply, Escalation
from greyhound.core.plan_build import NAMES, STRATEGIES, Culprit, JobState, Layout
from greyhound.core.tracked_incident import KINDS, Tracked
from services.common.bus.contract import Subjects
from services.common.db import exclusion
from services.common.db import repository as repo
from services.common.db.documents import Validation, plan_params
from services.common.db.models import Incident, Plan
from services.common.unit_of_work import UnitOfWork
from services.planner.delivery import announce, deliver, job_state, note, take_back
from services.planner.iterations import onset_lead_s
from services.planner.state import PlannerState

log = logging.getLogger(__name__)

IN_FORCE = ("approved", "applied")


def culprit_of(incident: Incident) -> Culprit:
    """The validated culprit in ranks, with each slow GPU's slowdown from its GEMM time."""
    detection, validation = incident.evidence.detection, incident.evidence.validation
    slowdown = (detection.after_s / detection.before_s if detection and detection.before_s
                and detection.after_s else float(incident.severity))
    return Culprit.from_validation(
        gpu_ranks=[g.rank for g in incident.culprit.gpus],
        link_ranks=[(a, b) for a, b in incident.culprit.link_ranks],
        gemm_s=validation.gemm_s or {} if validation else {}, slowdown=slowdown)


def in_layout(t: Tracked, state: JobState, layout: Layout) -> Culprit:
    """The culprit's ranks where its GPUs are now (a topology plan since moved ranks)."""
    if t.gpu_of_rank == state.gpu_of_rank:
        return t.culprit
    then = JobState(gpu_of_rank=t.gpu_of_rank).gpus(layout)
    now = state.gpus(layout)
    rank_now = {int(g): r for r, g in enumerate(now.tolist())}

    def move(r: int) -> int:
        return rank_now[int(then[r])] if 0 <= r < len(then) else r

    return Culprit({move(r): f for r, f in t.culprit.gpu_ranks.items()},
                   tuple((move(a), move(b)) for a, b in t.culprit.link_ranks), t.culprit.slowdown)


async def in_force(session: AsyncSession, job: str) -> list[Plan]:
    """The job's plans in force (delivered and not taken back), oldest version first."""
    rows = await repo.list_plans(session, job_id=job, limit=1000)
    return sorted((p for p in rows if p.status in IN_FORCE and p.version is not None),
                  key=lambda p: p.version or 0)


async def withdraw_undelivered(session: AsyncSession, incident: Incident) -> None:
    for plan in await repo.plans_of_incidents(session, [incident.id]):
        if plan.status == "proposed" or (plan.status == "approved" and plan.version is None):
            repo.move_plan(plan, "withdraw", reason="the fault ended before it took effect")
            await note(session, incident, "plan_withdrawn", plan, reason=plan.reason)


async def start(st: PlannerState, session: AsyncSession, incident: Incident,
                validation: Validation | None) -> Tracked | None:
    """The escalation of a validated incident, from S1, or None when there is nothing to act
    on (not confirmed, resolved, no layout declared, no healthy level known)."""
    kind = KINDS.get(incident.kind)
    if incident.status == "resolved" or validation is None or not validation.confirmed \
            or kind is None:
        return None  # nothing confirmed to act on (the checks could not reproduce it)
    layout = await st.layout(session, incident.job_id)
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
    c = st.config
    esc = Escalation(kind, healthy, await st.overheads(session, incident.job_id, layout),
                     tolerance=c.tolerance, alpha=c.alpha,
                     available=build.available(layout, culprit), expected_s=c.expected_s(kind),
                     trust=c.trust)
    t = Tracked(incident.id, incident.job_id, esc, culprit, gpu_of_rank=state.gpu_of_rank,
                preplan_s=detection.after_s or None if detection else None)
    lead = c.lookback_s
    if detection is not None:
        # it opened when first raised: at its suspicion, if it was suspected before confirmed
        at, suspected = detection.detected_iteration, detection.suspected_iteration
        if suspected is not None and detection.first_iteration <= suspected < at:
            at = suspected
        lead = onset_lead_s(detection.first_iteration, at, detection.after_s, c.lookback_s)
    onset = incident.opened_at - timedelta(seconds=lead)
    watch = st.watches.watch(incident.job_id, onset)
    # The slow iterations since the fault began count, not those before it: a watch kept from
    # an earlier incident of the job holds that incident's slow iterations, which would have
    # paid for this one's S3 before it was even validated (a phantom loss of 50-115 s).
    t.onset_ts = onset.timestamp()
    t.fed = watch.series.position_at(t.onset_ts)
    st.tracked[incident.id] = t
    await repo.save_escalation(session, t.incident_id, t.job_id, t.state())
    t.dirty = False
    log.info("incident %s (%s): escalation from S1, healthy %.3fs, ladder %s, overheads %s",
             incident.id, incident.kind, healthy, [s.name for s in esc.ladder],
             {s.name: round(v, 3) for s, v in esc.overheads.items()})
    return t


async def observe(st: PlannerState, job: str, _new: list[float] | None = None) -> None:
    """Feed every escalation of the job the iterations it has not seen (the watch calls this
    with each batch; each escalation keeps its own cursor, so none sees one twice)."""
    watch = st.watches.of.get(job)
    if watch is None:
        return
    async with st.locks[job]:
        for t in st.of_job(job):
            if t.esc.closed or t.incident_id not in st.tracked:
                t.fed = watch.series.count
                continue
            times = watch.series.since(t.fed, sent_from=t.onset_ts)
            t.fed = watch.series.count
            t.cursor = watch.cursor
            for s in times:
                decision = t.esc.observe(s)
                t.dirty = True
                if isinstance(decision, Apply):
                    await propose(st, t, decision)


async def propose(st: PlannerState, t: Tracked, d: Apply) -> None:
    """The strategy's plan, proposed; approved and delivered at once under an automatic
    policy. A strategy with nothing to change is failed, and the ladder moves past it."""
    name = NAMES[d.strategy]
    c = st.config
    async with st.work.unit() as uow:
        session = uow.session
        incident = await repo.get_incident_for_update(session, t.incident_id)
        layout = await st.layout(session, t.job_id)
        if incident is None or layout is None or incident.status == "resolved":
            t.esc.failed(d.strategy)
            uow.discard()
            return
        proposed = await exclusion.open_plan(session, t.incident_id, name)
        if proposed is not None:
            await already_proposed(session, t, d, proposed)
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
        if plan is None:  # proposed meanwhile by another planner (the index admits one)
            await already_proposed(session, t, d,
                                   await exclusion.open_plan(session, t.incident_id, name))
            return
        t.pending_plan = plan.id
        await note(session, incident, "plan_proposed", plan, summary=proposal.summary,
                   loss_s=round(d.loss_s, 6), overhead_s=round(d.overhead_s, 6),
                   policy=policy, expires_at=plan.expires_at.isoformat()
                   if plan.expires_at else None)
        dashboard = st.ctx.settings.api_public_url
        await announce(session, plan, "proposed", note_text=proposal.summary,
                       dashboard=dashboard)
        log.info("incident %s: proposed %s (%s, loss %.2fs >= %.2fs of its overhead %.2fs): %s",
                 t.incident_id, name, policy, d.loss_s, d.threshold_s, d.overhead_s,
                 proposal.summary)
        if policy == "automatic":
            await repo.decide_plan(session, plan, decision="approve", approver="policy",
                                   comment=f"{name} is automatic (GREYHOUND_PLANNER_"
                                           f"{name}_POLICY)")
            await note(session, incident, "plan_approved", plan, by="policy")
            await announce(session, plan, "approved", by="policy", dashboard=dashboard)
            msg = await deliver(session, plan, layout, t.esc.overheads.get(d.strategy))
            await uow.stage(Subjects.plan(t.job_id), msg)
        await repo.save_escalation(session, t.incident_id, t.job_id, t.state())
        t.dirty = False


async def already_proposed(session: AsyncSession, t: Tracked, d: Apply,
                           existing: Plan | None) -> None:
    """Another planner proposed this strategy for the incident (one open plan per incident and
    strategy): nothing is proposed, announced or delivered again; the escalation waits on
    ``existing`` as on its own plan (or moves past, should it be final already)."""
    if existing is None:
        t.esc.failed(d.strategy)
    t.pending_plan = None if existing is None else existing.id
    log.info("incident %s: %s already proposed (plan %s): not proposed again",
             t.incident_id, NAMES[d.strategy], t.pending_plan)
    await repo.save_escalation(session, t.incident_id, t.job_id, t.state())
    t.dirty = False


async def end(st: PlannerState, uow: UnitOfWork, t: Tracked | None, incident: Incident,
              why: str) -> None:
    """The fault is over: every plan of the incident goes (those in force are reverted,
    delivered like plans), and its escalation closes."""
    session = uow.session
    await withdraw_undelivered(session, incident)
    layout = await st.layout(session, incident.job_id)
    for plan in reversed(await in_force(session, incident.job_id)):
        if plan.incident_id != incident.id or layout is None:
            continue
        others = [p for p in await in_force(session, incident.job_id) if p.id != plan.id]
        cost = t.esc.overheads.get(STRATEGIES[plan.strategy]) if t is not None else None
        msg = await take_back(session, plan, layout, others_in_force=others, cost_s=cost)
        await uow.stage(Subjects.plan(plan.job_id), msg)
        action, stage = ("revert", "plan_reverted") if plan.status == "applied" \
            else ("withdraw", "plan_withdrawn")
        repo.move_plan(plan, action, reason=why)
        await note(session, incident, stage, plan, reason=why, version=msg.version)
        if action == "revert":
            await announce(session, plan, "reverted", note_text=why,
                           dashboard=st.ctx.settings.api_public_url)
        log.info("plan %s (%s) on job %s: %s as version %d (%s)", plan.id, plan.strategy,
                 plan.job_id, stage.removeprefix("plan_"), msg.version, why)
    if t is not None:
        t.esc.recovered()
        t.resolved = incident.status == "resolved"
        t.recovered_under_plan = False
        await repo.save_escalation(session, t.incident_id, t.job_id, t.state())
        st.forget(t)
