"""The REST surface: jobs and incidents (plans, approvals and webhooks join as they are built)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from services.api.schemas import ErrorOut, Health, IncidentOut, JobDetailOut, JobOut
from services.common.db import repository as repo

NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": ErrorOut, "description": "no such object"}}


async def session_dep(request: Request) -> AsyncIterator[AsyncSession]:
    """One session per request; read-only endpoints never commit."""
    maker: async_sessionmaker[AsyncSession] = request.app.state.sessions
    async with maker() as session:
        yield session


Session = Annotated[AsyncSession, Depends(session_dep)]


def create_app(sessions: async_sessionmaker[AsyncSession]) -> FastAPI:
    app = FastAPI(title="Greyhound", version="0.1.0",
                  description="Fail-slow and hang detection for distributed training jobs")
    app.state.sessions = sessions

    @app.get("/healthz", response_model=Health)
    async def healthz(session: Session) -> Health:
        try:
            await repo.ping(session)
            ok = True
        except OSError:
            ok = False
        return Health(status="ok" if ok else "degraded", database=ok)

    @app.get("/v1/jobs", response_model=list[JobOut])
    async def list_jobs(session: Session) -> list[JobOut]:
        return [JobOut.model_validate(j) for j in await repo.list_jobs(session)]

    @app.get("/v1/jobs/{job_id}", response_model=JobDetailOut, responses=NOT_FOUND)
    async def get_job(job_id: str, session: Session) -> JobDetailOut:
        job = await repo.get_job(session, job_id)
        if job is None:
            raise HTTPException(404, f"job {job_id!r} not found")
        return JobDetailOut.model_validate(job)

    @app.get("/v1/incidents", response_model=list[IncidentOut])
    async def list_incidents(
        session: Session,
        job_id: str | None = None,
        status: Literal["detected", "localized", "validated", "mitigated", "resolved"] | None = None,
        kind: str | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        offset: Annotated[int, Query(ge=0)] = 0,
    ) -> list[IncidentOut]:
        rows = await repo.list_incidents(session, job_id=job_id, status=status, kind=kind,
                                         limit=limit, offset=offset)
        return [IncidentOut.model_validate(i) for i in rows]

    @app.get("/v1/incidents/{incident_id}", response_model=IncidentOut, responses=NOT_FOUND)
    async def get_incident(incident_id: str, session: Session) -> IncidentOut:
        inc = await repo.get_incident(session, incident_id)
        if inc is None:
            raise HTTPException(404, f"incident {incident_id!r} not found")
        return IncidentOut.model_validate(inc)

    return app
