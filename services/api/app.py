"""The REST surface: jobs, ranks, incidents, plans, the fleet, webhooks, tokens, probes, metrics
and the dashboard (a static page under /dashboard that calls this same API)."""

from __future__ import annotations

from pathlib import Path

from fastapi import Depends, FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from services.api.deps import Bus
from services.api.errors import install_handlers, reject_unstorable
from services.api.middleware import Buckets, Guard
from services.api.openapi import install_openapi
from services.api.routes import fleet, incidents, job_plans, jobs, ops, plans, tokens, webhooks
from services.api.settings import ApiSettings
from services.api.tokens import token_key
from services.common.outbox import Outbox
from services.common.settings import Settings
from services.common.unit_of_work import Work

STATIC = Path(__file__).resolve().parent / "static"


def create_app(sessions: async_sessionmaker[AsyncSession], *, settings: Settings,
               api: ApiSettings, nc: NATS | None = None,
               js: JetStreamContext | None = None) -> FastAPI:
    """``settings`` are what every process shares, ``api`` the API's own (run_api reads them
    from the environment). Raises MissingTokenKey on a configured database without
    GREYHOUND_TOKEN_KEY (services.api.tokens.token_key)."""
    token_key(settings)
    # No Swagger UI or ReDoc: FastAPI loads them from a CDN into this origin, where a script
    # of someone else's would run beside the dashboard's tokens; /openapi.json stays.
    app = FastAPI(title="Greyhound", version="0.2.0",
                  description="Fail-slow and hang detection for distributed training jobs",
                  dependencies=[Depends(reject_unstorable)], docs_url=None, redoc_url=None)
    app.state.settings = settings
    app.state.api_settings = api
    app.state.bus = Bus(nc=nc, js=js)
    # what a route announces (a close, a job's report) goes out after its commit, through the
    # API's outbox; without a bus it waits there for an API process that has one
    app.state.work = Work(sessions, Outbox(sessions, js, producer="api",
                                           poll_s=settings.outbox_poll_s,
                                           grace_s=settings.outbox_grace_s))
    install_handlers(app)
    routers = [m.router for m in (ops, jobs, job_plans, incidents, plans, fleet, webhooks,
                                   tokens)]
    for router in routers:
        app.include_router(router)
    app.mount("/dashboard", StaticFiles(directory=STATIC, html=True), name="dashboard")

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/dashboard/")

    app.add_middleware(Guard, max_body_bytes=api.api_max_body_bytes,
                       requests=Buckets(api.api_rate_per_s, api.api_rate_burst),
                       auth_failures=Buckets(api.api_auth_failures_per_min / 60.0,
                                             api.api_auth_failures_per_min))

    install_openapi(app, routers)
    return app
