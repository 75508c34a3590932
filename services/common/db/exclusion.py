"""Per-job exclusion across every instance of a service: the SQL that lets N validators and N
planners share one database without two of them touching a job at once. Like the repository
(services.common.db.repository), functions take the caller's session and never commit.

* **One validation per job** (``job_validations``): a row per job under validation, naming its
  holder (a validator and the suspicion it validates) with a lease. A row, not an advisory
  lock: a session advisory lock lives as long as a pooled connection, so a validator would pin
  one for a whole validation and lose the lock silently (while the job stays paused) when that
  connection drops, and a dead holder's lock is released only when Postgres notices the
  connection is gone (TCP keep-alives: minutes or more on a partition); a transaction-scoped
  one would keep a transaction open across the pause. A lease ends at a bounded time whatever
  happened to the holder, can be read (who pauses this job?), and is taken and renewed by short
  statements. Every time is the database's own (``now()``): validators on several machines
  never compare their clocks.
* **Plan versions per job** (``jobs.plan_version``): one atomic ``UPDATE ... RETURNING`` hands
  out the next version; it locks the job's row until the caller commits, so versions of a job
  are committed in the order they were handed out, whichever planner asked.
* **One open plan per incident and strategy**: the partial unique index
  ``uq_plans_open_strategy`` (services.common.db.repository.create_plan inserts with ON
  CONFLICT DO NOTHING: a second planner's proposal is "already proposed", not an error).
* **The open-incident race**: two detections that both find no open incident both insert one;
  the unique index ``uq_incidents_open_dedup`` refuses the second once the first committed
  (``open_incident_taken`` tells that refusal from other integrity errors, so the caller can
  run its unit of work again and find the first one's incident).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ColumnElement, delete, func, literal, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from services.common.db.models import OPEN_PLAN_STATUSES, Job, JobValidation, Plan

OPEN_INCIDENT_INDEX = "uq_incidents_open_dedup"


def _lease(lease_s: float) -> ColumnElement[datetime]:
    """``lease_s`` seconds from now, by the database's clock."""
    return func.now() + func.make_interval(0, 0, 0, 0, 0, 0, literal(lease_s))


async def take_job_validation(session: AsyncSession, *, job_id: str, holder: str,
                              suspicion_id: str, lease_s: float) -> bool:
    """Take the job for the validation of ``suspicion_id`` by ``holder`` for ``lease_s``
    seconds: True when nobody holds it, its holder's lease lapsed (it died), or this holder
    has it for this suspicion already; False while another validation holds it."""
    stmt = insert(JobValidation).values(job_id=job_id, holder=holder, suspicion_id=suspicion_id,
                                        lease_until=_lease(lease_s))
    taken = stmt.on_conflict_do_update(
        index_elements=[JobValidation.job_id],
        set_={"holder": stmt.excluded.holder, "suspicion_id": stmt.excluded.suspicion_id,
              "lease_until": stmt.excluded.lease_until, "taken_at": func.now()},
        where=(JobValidation.lease_until < func.now())
        | ((JobValidation.holder == holder) & (JobValidation.suspicion_id == suspicion_id)))
    return (await session.execute(taken.returning(JobValidation.job_id))).first() is not None


async def renew_job_validation(session: AsyncSession, *, job_id: str, holder: str,
                               suspicion_id: str, lease_s: float) -> bool:
    """Extend the holder's lease on the job; False when it no longer holds it."""
    res = await session.execute(
        update(JobValidation)
        .where(JobValidation.job_id == job_id, JobValidation.holder == holder,
               JobValidation.suspicion_id == suspicion_id)
        .values(lease_until=_lease(lease_s)).returning(JobValidation.job_id))
    return res.first() is not None


async def release_job_validation(session: AsyncSession, *, job_id: str, holder: str,
                                 suspicion_id: str) -> bool:
    """The holder is done with the job (it resumed it); False when it no longer held it."""
    res = await session.execute(
        delete(JobValidation)
        .where(JobValidation.job_id == job_id, JobValidation.holder == holder,
               JobValidation.suspicion_id == suspicion_id)
        .returning(JobValidation.job_id))
    return res.first() is not None


async def job_validation(session: AsyncSession, job_id: str) -> JobValidation | None:
    """Who validates the job now, if anyone (the lease may have lapsed)."""
    return await session.get(JobValidation, job_id, populate_existing=True)


async def next_plan_version(session: AsyncSession, job_id: str) -> int:
    """The job's next plan version, handed out once: its row stays locked until the caller
    commits, so a second planner's version is the one after and is committed after it."""
    return int((await session.execute(
        update(Job).where(Job.id == job_id).values(plan_version=Job.plan_version + 1)
        .returning(Job.plan_version))).scalar_one())


async def open_plan(session: AsyncSession, incident_id: str, strategy: str) -> Plan | None:
    """The incident's open plan of ``strategy`` (at most one: ``uq_plans_open_strategy``)."""
    return await session.scalar(
        select(Plan).where(Plan.incident_id == incident_id, Plan.strategy == strategy,
                           Plan.status.in_(OPEN_PLAN_STATUSES)))


def open_incident_taken(exc: BaseException) -> bool:
    """Whether ``exc`` is the open-incident index refusing a second open incident of a job and
    key (another unit opened it and committed first), and not any other integrity error."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if getattr(e, "constraint_name", None) == OPEN_INCIDENT_INDEX:
            return True
        todo += [c for c in (getattr(e, "orig", None), e.__cause__, e.__context__)
                 if isinstance(c, BaseException)]
    return False

