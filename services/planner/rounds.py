"""The planner's periodic round, functions over its state: what happens between messages.

Plans an operator approved since go into force; proposals past their time expire; an escalation
whose plan was rejected or expired moves on; plans for a slow GPU are re-checked with the
validator; a plan kept after its incident recovered under it is taken back after ``hold_max_s``;
escalation states are saved every few seconds; watches nobody needs any more end. With several
planners (services.common.ownership) each round touches only the plans of its partition's jobs.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime

from greyhound.core.plan_build import STRATEGIES
from greyhound.core.tracked_incident import Tracked
from services.common.bus.contract import Subjects, Suspicion
from services.common.db import repository as repo
from services.planner import escalations
from services.planner.delivery import deliver, job_state, note
from services.planner.state import PlannerState

log = logging.getLogger(__name__)

# how much earlier than a saved cursor's batch a restored watch starts: the stream's clock is not
# the agent's (the iterations before the cursor are skipped by number)
RESUME_MARGIN_S = 30.0


async def tick(st: PlannerState) -> None:
    await deliver_approved(st)
    await expire(st)
    await decisions(st)
    await rechecks(st)
    await hold_limits(st)
    await silent_jobs(st)
    await save(st)
    st.watches.drop_idle({t.job_id for t in st.tracked.values()})
    await st.work.send_pending()


async def deliver_approved(st: PlannerState) -> None:
    """Plans an operator approved since: into force, unless their incident is over."""
    async with st.work.unit() as uow:
        session = uow.session
        plans = await repo.approved_undelivered(session, ("S2", "S3"), jobs=st.part.jobs)
        for plan in plans:
            t = st.tracked.get(plan.incident_id)
            incident = await repo.get_incident_for_update(session, plan.incident_id)
            layout = await st.layout(session, plan.job_id)
            if incident is None or incident.status == "resolved" or layout is None or (
                    t is not None and t.esc.closed):
                repo.move_plan(plan, "withdraw", reason="the fault ended before it was "
                               "delivered" if layout else "the job's layout is unknown")
                await note(session, incident, "plan_withdrawn", plan, reason=plan.reason)
                continue
            cost = t.esc.overheads.get(STRATEGIES[plan.strategy]) if t else None
            msg = await deliver(session, plan, layout, cost)
            await uow.stage(Subjects.plan(plan.job_id), msg)
            log.info("plan %s (%s) approved by an operator: delivered to job %s as "
                     "version %d", plan.id, plan.strategy, plan.job_id, msg.version)


async def expire(st: PlannerState) -> None:
    async with st.work.unit() as uow:
        for plan in await repo.due_proposals(uow.session, datetime.now(UTC),
                                             jobs=st.part.jobs):
            repo.move_plan(plan, "expire", reason=f"no decision within "
                           f"{st.config.proposal_ttl_s:g} s")
            incident = await repo.get_incident_for_update(uow.session, plan.incident_id)
            await note(uow.session, incident, "plan_expired", plan, reason=plan.reason)
            log.info("plan %s (%s) expired", plan.id, plan.strategy)


async def decisions(st: PlannerState) -> None:
    """Pending plans that were rejected or expired (or withdrawn): the ladder moves past."""
    waiting = {t.pending_plan: t for t in st.tracked.values() if t.pending_plan}
    if not waiting:
        return
    async with st.work.read() as session:
        plans = await repo.plans_by_id(session, [p for p in waiting if p])
    for plan_id, plan in plans.items():
        t = waiting[plan_id]
        if plan.status not in ("rejected", "expired", "withdrawn", "failed"):
            continue
        async with st.locks[t.job_id]:
            strategy = STRATEGIES[plan.strategy]
            if t.esc.pending is strategy:
                t.esc.failed(strategy)
            t.pending_plan = None
            t.dirty = True
            log.info("incident %s: %s %s; the escalation moves on", t.incident_id,
                     plan.strategy, plan.status)


async def rechecks(st: PlannerState) -> None:
    c = st.config
    if c.recheck_s <= 0:
        return
    now = time.monotonic()
    for t in list(st.tracked.values()):
        if not t.checkable:
            continue
        if t.recheck_id is not None:
            if now - t.recheck_at > c.recheck_timeout_s:
                log.warning("incident %s: re-check %s unanswered; retrying later",
                            t.incident_id, t.recheck_id)
                t.recheck_id, t.last_check_at = None, now
            continue
        if now - t.last_check_at < c.recheck_s:
            continue
        async with st.work.unit() as uow:
            session = uow.session
            plans = [p for p in await repo.plans_of_incidents(session, [t.incident_id])
                     if p.status == "applied"]
            layout = await st.layout(session, t.job_id)
            state, _ = await job_state(session, t.job_id)
            if not plans or layout is None:
                continue
            culprit = escalations.in_layout(t, state, layout)
            s = Suspicion(job_id=t.job_id, incident_id=t.incident_id, kind="compute_slow",
                          ranks=sorted(culprit.gpu_ranks), comm_ids=[],
                          evidence={"by": "planner", "recheck": [p.id for p in plans]})
            await uow.stage(Subjects.suspicion(t.job_id), s)
        t.recheck_id, t.recheck_at = s.event_id, now
        log.info("incident %s: asking the validator whether ranks %s are still slow",
                 t.incident_id, s.ranks)


async def hold_limits(st: PlannerState) -> None:
    """A plan kept after its incident recovered under it, whose fault nothing can check, is
    taken back after ``hold_max_s``: if the fault is still there, the job slows again and the
    escalation starts over, with what this plan cost learned."""
    c = st.config
    if c.hold_max_s <= 0:
        return
    now = time.monotonic()
    for t in list(st.tracked.values()):
        if not (t.resolved and t.resolved_at is not None) or t.checkable:
            continue
        if now - t.resolved_at < c.hold_max_s:
            continue
        await _end(st, t, f"held {c.hold_max_s:g} s after the job recovered under it; "
                   "nothing can check the fault")


async def _end(st: PlannerState, t: Tracked, why: str) -> None:
    """End ``t``'s escalation outside a handler: its job's lock, its incident's row lock, its
    plans taken back (an escalation whose incident is gone is only forgotten)."""
    log.info("incident %s: escalation ended: %s", t.incident_id, why)
    async with st.locks[t.job_id], st.work.unit() as uow:
        incident = await repo.get_incident_for_update(uow.session, t.incident_id)
        if incident is not None:
            await escalations.end(st, uow, t, incident, why)
        else:
            st.forget(t)


async def silent_jobs(st: PlannerState) -> None:
    """Escalations of jobs that stopped sending iterations end, their plans taken back: a job
    that finished or died in the middle of an incident left its escalation open, restored by
    every planner since and re-checked on a job whose agents no longer answer (a data
    directory used for a day of demo runs held 15)."""
    c = st.config
    if c.job_silent_s <= 0:
        return
    for t in list(st.tracked.values()):
        watch = st.watches.of.get(t.job_id)
        silent = watch.silent_s() if watch is not None else None
        if silent is None or silent < c.job_silent_s:
            continue
        await _end(st, t, f"job {t.job_id} sent no iteration for {silent:.0f} s (over "
                   f"{c.job_silent_s:g} s): it stopped or is gone")


async def save(st: PlannerState, *, now: bool = False) -> None:
    """Every escalation that changed since it was saved, every few seconds (``now``: at once,
    as on shutdown)."""
    if not now and time.monotonic() - st.saved_at < 5.0:
        return
    st.saved_at = time.monotonic()
    dirty = [t for t in st.tracked.values() if t.dirty]
    if not dirty:
        return
    async with st.work.unit() as uow:
        for t in dirty:
            await repo.save_escalation(uow.session, t.incident_id, t.job_id, t.state())
            t.dirty = False


async def restore(st: PlannerState) -> None:
    """Escalations of open incidents (or with plans still in force) of the jobs this planner
    owns, from the database."""
    async with st.work.read() as session:
        rows = [(row, i) for row, i in await repo.open_escalations(session)
                if st.owns(row.job_id)]
    restored: list[Tracked] = []
    for row, incident in rows:
        try:
            t = Tracked.from_state(row.incident_id, row.job_id, row.state)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("escalation of incident %s not restored: %s", row.incident_id, exc)
            continue
        if incident.status == "resolved":
            t.resolved, t.resolved_at = True, time.monotonic()
        t.last_check_at = time.monotonic()
        st.tracked[t.incident_id] = t
        restored.append(t)
        log.info("incident %s of job %s: escalation restored (%s, plan pending %s)",
                 t.incident_id, t.job_id, "resolved under its plan" if t.resolved
                 else "open", t.pending_plan)
    for job in sorted({t.job_id for t in restored}):
        _resume(st, job, [t for t in restored if t.job_id == job])
    if rows:
        log.info("restored %d escalation(s)", len(st.tracked))


def _resume(st: PlannerState, job: str, tracked: list[Tracked]) -> None:
    """The job's watch from the earliest iteration a restored loss did not count yet (the
    saved loss counts up to its cursor; the iterations after it, those a killed planner had
    read but not saved and those sent while it was down, are read again), each escalation
    skipping the ones its own cursor passed; without a cursor, from now on."""
    cursors = [t.cursor for t in tracked if t.cursor is not None]
    if not cursors:
        st.watches.watch(job, datetime.now(UTC))
        return
    rank, first, ts = min(cursors, key=lambda c: (c[0], c[1]))
    watch = st.watches.watch(job, datetime.fromtimestamp(ts - RESUME_MARGIN_S, UTC))
    watch.resume(rank, first, max(c[2] for c in cursors))
    for t in tracked:
        t.fed = t.cursor[1] - first if t.cursor is not None and t.cursor[0] == rank else 0


async def close(st: PlannerState) -> None:
    """On shutdown: the watches end, and every escalation is saved as it stands."""
    await st.watches.close()
    try:
        await save(st, now=True)
    except Exception:
        log.exception("could not save escalation state on shutdown")
