"""Liveness, readiness and metrics: open to probes and scrapers (metrics closable by setting)."""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials

from services.api import metrics
from services.api.auth import bearer, require
from services.api.deps import ApiSettingsDep, BusDep, Session
from services.api.schemas import Health, Readiness
from services.common.bus.errors import describe
from services.common.db import repository as repo
from services.common.unit_of_work import Work

log = logging.getLogger(__name__)
router = APIRouter(tags=["operations"])
PROBE_TIMEOUT_S = 2.0


@router.get("/healthz", response_model=Health, summary="The process is up (no dependency checked)")
async def healthz() -> Health:
    return Health()


@router.get("/readyz", response_model=Readiness, summary="NATS and Postgres are reachable",
            responses={503: {"model": Readiness, "description": "a dependency is unreachable"}})
async def readyz(request: Request, bus: BusDep) -> JSONResponse:
    # An open route: what failed is said in a word, its details (host names, addresses, the
    # driver's text) go to the API's log.
    checks: dict[str, str] = {}
    try:
        await asyncio.wait_for(asyncio.shield(_ping(request.app.state.work)), PROBE_TIMEOUT_S)
        checks["database"] = "ok"
    except Exception as exc:
        log.warning("readiness: the database did not answer: %s", describe(exc))
        checks["database"] = "unreachable"
    if bus.nc is None or bus.js is None:
        checks["nats"] = "not configured"
    elif not bus.nc.is_connected:
        checks["nats"] = "disconnected"
    else:
        try:
            await asyncio.wait_for(bus.js.account_info(), PROBE_TIMEOUT_S)
            checks["nats"] = "ok"
        except Exception as exc:
            log.warning("readiness: NATS did not answer: %s", describe(exc))
            checks["nats"] = "unreachable"
    ok = all(v == "ok" for v in checks.values())
    body = Readiness(status="ready" if ok else "not ready", checks=checks)
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503)


def _ping(work: Work) -> asyncio.Task[None]:
    """The database ping on a session of its own, in a task of its own: the probe's timeout
    gives up waiting, never cancels the query. A query cancelled mid-operation invalidated the
    request's session (its commit failed: a 500) and left a connection mid-operation to a
    cleanup that could be cancelled in turn (a client gone); this one ends by itself."""
    async def ping() -> None:
        async with work.read() as session:
            await repo.ping(session)

    return asyncio.ensure_future(ping())


async def _metrics_access(request: Request, settings: ApiSettingsDep,
                          creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
                          ) -> None:
    if not settings.api_metrics_public:
        await require("viewer")(request, creds)


@router.get("/metrics", summary="Prometheus metrics (text exposition format)",
            description="Open unless GREYHOUND_API_METRICS_PUBLIC=false, then a viewer token.",
            response_class=Response,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                             "description": "Prometheus text format 0.0.4"}},
            dependencies=[Depends(_metrics_access)])
async def metrics_route(session: Session, bus: BusDep) -> Response:
    body = await metrics.render(session, bus.js)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
