"""Jobs: their topology and live state, their ranks, and a window of their iteration times."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query, Response

from services.api.auth import Viewer
from services.api.deps import BusDep, Session, problems
from services.api.errors import NotFound
from services.api.schemas import (
    JobDetailOut,
    JobOut,
    JobState,
    RankOut,
    RankStateOut,
    TimelineMarker,
    TimelineOut,
)
from services.api.telemetry import Window, read_window
from services.api.timeline import job_timeline, rank_states
from services.common.bus.errors import describe
from services.common.db import repository as repo
from services.common.db.models import Incident, Job
from services.common.incident_cost import cost_of

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


def job_state(open_incidents: Sequence[Incident]) -> JobState:
    if any(i.kind.startswith("hang") for i in open_incidents):
        return "hung"
    return "slow" if open_incidents else "healthy"


def _job_out(job: Job, incidents: Sequence[Incident], ranks: int) -> JobOut:
    mine = [i for i in incidents if i.job_id == job.id]
    return JobOut(id=job.id, world_size=job.world_size, topology=job.topology.as_json(),
                  first_seen_at=job.first_seen_at, last_seen_at=job.last_seen_at,
                  state=job_state(mine), open_incidents=len(mine), ranks_known=ranks)


@router.get("", response_model=list[JobOut], summary="Jobs, most recently seen first",
            description="Paged with limit/offset; the total is in the X-Total-Count header. "
                        "`state` is hung (an open hang incident), slow (another open incident) "
                        "or healthy.", responses=problems(401, 403, 422))
async def list_jobs(session: Session, response: Response, _: Viewer,
                    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0) -> list[JobOut]:
    jobs = await repo.list_jobs_page(session, limit=limit, offset=offset)
    ids = [j.id for j in jobs]
    incidents = await repo.open_incidents_of(session, ids)
    counts = await repo.rank_counts(session, ids)
    response.headers["X-Total-Count"] = str(await repo.count_jobs(session))
    return [_job_out(j, incidents, counts.get(j.id, 0)) for j in jobs]


async def _job_or_404(session: Session, job_id: str) -> Job:
    job = await repo.get_job(session, job_id)
    if job is None:
        raise NotFound(f"job {job_id!r} not found")
    return job


@router.get("/{job_id}", response_model=JobDetailOut, summary="One job with its ranks",
            responses=problems(401, 403, 404))
async def get_job(job_id: str, session: Session, _: Viewer) -> JobDetailOut:
    job = await _job_or_404(session, job_id)
    incidents = await repo.open_incidents_of(session, [job.id])
    base = _job_out(job, incidents, len(job.ranks))
    return JobDetailOut(**base.model_dump(),
                        ranks=[RankOut.model_validate(r) for r in job.ranks])


async def _window(bus: BusDep, job_id: str, window_s: float,
                  collectives: bool) -> tuple[Window | None, str | None]:
    if bus.js is None:
        return None, "no connection to NATS"
    try:
        return await read_window(bus.js, job_id, window_s=window_s, collectives=collectives), None
    except Exception as exc:  # the telemetry is a bonus: the database answer stands without it
        # the details (host names, addresses) go to the log, not to whoever asked
        log.warning("reading telemetry of %s failed: %s", job_id, describe(exc))
        return None, "the telemetry stream did not answer (the API's log says why)"


@router.get("/{job_id}/ranks", response_model=list[RankStateOut],
            summary="The job's ranks with their newest iteration and state",
            description="Iterations come from the telemetry stream (the last `window_s` seconds).",
            responses=problems(401, 403, 404, 422))
async def job_ranks(job_id: str, session: Session, bus: BusDep, _: Viewer,
                    window_s: Annotated[float, Query(gt=0, le=3600)] = 120.0
                    ) -> list[RankStateOut]:
    job = await _job_or_404(session, job_id)
    # Until it is localised, an incident's ranks are those whose detectors fired (all of a
    # synchronous job), not suspects.
    suspects = {r for i in await repo.open_incidents_of(session, [job.id]) if i.status != "detected"
                for r in i.culprit.ranks}
    window, _err = await _window(bus, job.id, window_s, collectives=False)
    states = {s.rank: s for s in rank_states(window.iterations if window else [],
                                             [r.rank for r in job.ranks],
                                             now=datetime.now(UTC))}
    out = []
    for r in job.ranks:
        s = states.get(r.rank)
        state = "suspect" if r.rank in suspects else (s.state if s else "unknown")
        out.append(RankStateOut(**RankOut.model_validate(r).model_dump(),
                                last_iteration=s.last_iteration if s else None,
                                last_iteration_s=s.last_iteration_s if s else None,
                                last_iteration_at=s.last_end if s else None, state=state))
    return out


@router.get("/{job_id}/timeline", response_model=TimelineOut,
            summary="Iteration times, a per-rank heat map, and incident and plan markers",
            description="Buckets over the last `window_s` seconds of telemetry. The heat map is "
                        "lateness at collectives (ms) where the job was profiled in the window, "
                        "else each rank's iteration time over the job's healthy level.",
            responses=problems(401, 403, 404, 422))
async def job_timeline_route(job_id: str, session: Session, bus: BusDep, _: Viewer,
                             window_s: Annotated[float, Query(gt=0, le=3600)] = 600.0,
                             buckets: Annotated[int, Query(ge=1, le=600)] = 120) -> TimelineOut:
    job = await _job_or_404(session, job_id)
    now = datetime.now(UTC)
    since = now - timedelta(seconds=window_s)
    window, err = await _window(bus, job.id, window_s, collectives=True)
    tl = job_timeline(window.iterations if window else [], window.collectives if window else [],
                      since=since, until=now, buckets=buckets)
    markers = [TimelineMarker(at=c.onset_at, until=i.resolved_at, kind="incident", id=i.id,
                              label=f"{i.kind}: {i.summary}"[:200], status=i.status)
               for i in await repo.list_incidents(session, job_id=job.id, limit=200,
                                                  opened_after=since)
               if (c := cost_of(i, gpus=None, now=now))]
    markers += [TimelineMarker(at=p.created_at, kind="plan", id=p.id,
                               label=f"plan {p.strategy}", status=p.status)
                for p in await repo.list_plans(session, job_id=job.id, limit=200)
                if p.created_at >= since]
    return TimelineOut(job_id=job.id, start=tl.start, bucket_s=tl.bucket_s, times=tl.times,
                       median_s=tl.median_s, max_s=tl.max_s, ranks=tl.ranks, heat=tl.heat,
                       heat_basis=tl.heat_basis, heat_unit=tl.heat_unit,
                       markers=sorted(markers, key=lambda m: m.at),
                       truncated=bool(window and window.truncated), telemetry_error=err)
