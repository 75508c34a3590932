"""A training job's side of mitigation: declare its layout, read the plan it must run, and say
what it did with it.

The planner owns plans; this is the job's window on them. ``GET /plan`` is the job's newest
delivery (the same message the planner publishes on ``Subjects.plan(job)``). A report is not
written here: it is checked against the delivery it names and handed to the planner over the
bus (``Subjects.plan_report``), which moves the plan and learns the cost, hence ``202``.
"""

from __future__ import annotations

from fastapi import APIRouter

from greyhound.ids import check_token
from services.api.auth import OwnJob, Viewer
from services.api.deps import BusDep, Session, Unit, problems
from services.api.errors import Conflict, Invalid, NotFound
from services.api.schemas import JobPlanOut, PlanReportAccepted, PlanReportIn
from services.common.bus.contract import JobLayout, PlanReport, Subjects
from services.common.db import repository as repo

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


@router.get("/{job_id}/plan", response_model=JobPlanOut, summary="The plan the job must run now",
            description="The job's newest delivery: version 0 with nulls when it has none (its "
                        "own layout). A job applies a version above the one it runs, at an "
                        "iteration boundary, then reports it.",
            responses=problems(401, 403, 404))
async def current_plan(job_id: str, session: Session, _: Viewer) -> JobPlanOut:
    if await repo.get_job(session, job_id) is None:
        raise NotFound(f"job {job_id!r} not found")
    d = await repo.current_delivery(session, job_id)
    if d is None:
        return JobPlanOut(job_id=job_id, version=0)
    m = d.message
    return JobPlanOut(job_id=job_id, version=d.version, plan_id=d.plan_id,
                      incident_id=m.incident_id, strategy=m.strategy, action=m.action,
                      microbatches=m.microbatches, gpu_of_rank=m.gpu_of_rank, swaps=m.swaps,
                      cost_s=m.cost_s, summary=m.summary, issued_at=d.at, reported=d.outcome)


@router.put("/{job_id}/layout", response_model=JobLayout, summary="Declare the job's layout",
            description="Needs the job's own token (or operator). TP/DP/PP sizes, GPUs per node, the global "
                        "batch's micro-batches and their multiple; what the planner builds "
                        "plans from. Creates the job if the agents have not announced it yet.",
            responses=problems(401, 403, 422))
async def declare_layout(job_id: str, body: JobLayout, session: Session,
                         who: OwnJob) -> JobLayout:
    try:
        check_token(job_id, "job id")
    except ValueError as exc:
        raise Invalid(str(exc)) from None
    await repo.set_job_layout(session, job_id, body)
    await repo.audit(session, actor=who.name, token_id=who.token_id, action="job.layout",
                     target_type="job", target_id=job_id, detail=body.model_dump())
    return body


@router.post("/{job_id}/plan/applied", response_model=PlanReportAccepted, status_code=202,
             summary="Report that the job applied (or could not apply) a plan version",
             description="Needs the job's own token (or operator). 404 for a version never "
                         "delivered, 409 for one reported already, 503 without the bus. The "
                         "planner records it.",
             responses=problems(401, 403, 404, 409, 422, 503))
async def report_plan(job_id: str, body: PlanReportIn, uow: Unit, bus: BusDep,
                      who: OwnJob) -> PlanReportAccepted:
    session = uow.session
    sent = await repo.get_delivery(session, job_id, body.version)
    if sent is None:
        raise NotFound(f"job {job_id!r} has no plan version {body.version}")
    if sent.outcome is not None:
        raise Conflict(f"version {body.version} was reported {sent.outcome} already")
    bus.jetstream()  # 503 before anything is recorded
    msg = PlanReport(job_id=job_id, version=body.version, outcome=body.outcome,
                     cost_s=body.cost_s, error=body.error, reporter=who.name)
    await repo.audit(session, actor=who.name, token_id=who.token_id, action="plan.report",
                     target_type="plan", target_id=sent.plan_id,
                     detail={"version": body.version, "outcome": body.outcome,
                             "cost_s": body.cost_s, "event_id": msg.event_id})
    await uow.stage(Subjects.plan_report(job_id), msg)
    return PlanReportAccepted(job_id=job_id, version=body.version, outcome=body.outcome,
                              event_id=msg.event_id)
