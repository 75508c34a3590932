"""An API on a fresh database and the session's bus (as the API's bus user), with one token per
role and seeded rows; the operator's connection to see what it published."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from services.api.app import create_app
from services.api.settings import ApiSettings
from services.api.tokens import display_prefix, hash_token, new_token
from services.common.bus.client import BusClient
from services.common.bus.contract import JobLayout, PlanMessage
from services.common.db import repository as repo
from services.common.db.documents import (
    Culprit,
    Detection,
    Evidence,
    MicrobatchParams,
    OperatorNote,
    Topology,
)
from services.common.db.models import Plan, PlanDelivery
from services.common.runtime import ServiceContext, start_service
from services.common.settings import Settings
from tests.conftest import Bus

# an S2 plan's parameters, as the planner records them
MICROBATCHES = MicrobatchParams(kind="microbatch", microbatches=[6, 6, 4, 8],
                                previous=[6, 6, 6, 6], times=[1.0, 1.0, 1.5, 1.0], multiple_of=1,
                                slow_dp_groups=[2], makespan_before=9.0, makespan_after=8.0)
WEBHOOK_KEY = "test-webhook-key-0123456789abcdef"
TOKEN_KEY = "test-token-pepper"
ROLES = ("viewer", "job", "operator", "admin")
JOB_OF_JOB_TOKEN = "job-a"  # the job the fixture's job token acts for


@dataclass
class Api:
    ctx: ServiceContext
    app: FastAPI
    client: httpx.AsyncClient
    tokens: dict[str, str] = field(default_factory=dict)
    bus: Bus | None = None

    async def operator(self) -> BusClient:
        """A connection that sees everything on the bus (close it when done)."""
        assert self.bus is not None
        return await self.bus.connect()

    def auth(self, role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[role]}"}

    async def job_token(self, job_id: str) -> dict[str, str]:
        """The headers of a job token for ``job_id`` (made once, named after the job)."""
        if job_id not in self.tokens:
            self.tokens[job_id] = await self.token("job", "job-user", job_id=job_id)
        return self.auth(job_id)

    async def token(self, role: str, name: str, *, expires_at: datetime | None = None,
                    job_id: str | None = None) -> str:
        secret = new_token()
        async with self.ctx.db()() as session:
            await repo.create_token(session, name=name, role=role,
                                    token_hash=hash_token(secret, TOKEN_KEY.encode()),
                                    prefix=display_prefix(secret), created_by="test",
                                    expires_at=expires_at, job_id=job_id)
            await session.commit()
        return secret

    async def job(self, job_id: str, world_size: int = 4, hosts: tuple[str, ...] = ("node-a",),
                  gpus_per_host: int = 4) -> None:
        async with self.ctx.db()() as session:
            await repo.touch_job(session, job_id, world_size=world_size, topology=Topology(
                layout=JobLayout(tp=1, dp=world_size, pp=1, gpus_per_node=world_size,
                                 microbatches=world_size)))
            ranks = [{"rank": r, "host": hosts[r // gpus_per_host % len(hosts)],
                      "node": r // gpus_per_host, "device": r % gpus_per_host, "pid": 100 + r}
                     for r in range(world_size)]
            await repo.upsert_ranks(session, job_id, "agent-1", ranks)
            await session.commit()

    async def incident(self, job_id: str, *, kind: str = "slowdown", before_s: float = 1.0,
                       after_s: float = 1.5, culprit: Culprit | None = None,
                       evidence: Evidence | None = None, dedup: str | None = None,
                       stages: tuple[str, ...] = ()) -> str:
        detail = Detection(event_id=new_token()[:32], method="bocd-v", first_iteration=100,
                           detected_iteration=104, before_s=before_s, after_s=after_s,
                           ranks=[0, 1, 2, 3])
        async with self.ctx.db()() as session:
            inc = await repo.open_incident(
                session, job_id=job_id, kind=kind, dedup_key=dedup or f"d-{new_token()[:12]}",
                severity=after_s / before_s if before_s else 1.0, summary=f"job {job_id} {kind}",
                culprit=culprit or Culprit(ranks=[2]), evidence=evidence or Evidence(),
                stage_detail=detail)
            for stage in stages:
                await repo.add_timeline(session, inc, stage, OperatorNote(by="test", note=""))
            await session.commit()
            return inc.id

    async def plan(self, incident_id: str, job_id: str, strategy: str = "S2") -> str:
        async with self.ctx.db()() as session:
            plan = Plan(incident_id=incident_id, job_id=job_id, strategy=strategy,
                        params=MICROBATCHES, expected_gain=1.3)
            session.add(plan)
            await session.commit()
            return plan.id


    async def deliver(self, plan_id: str, job_id: str, version: int = 1,
                      microbatches: list[int] | None = None) -> None:
        """A delivery of the plan, as the planner writes it."""
        async with self.ctx.db()() as session:
            plan = await session.get(Plan, plan_id)
            assert plan is not None
            plan.status, plan.version = "approved", version
            session.add(PlanDelivery(job_id=job_id, version=version, plan_id=plan_id,
                                     action="apply", message=PlanMessage(
                                         job_id=job_id, version=version, plan_id=plan_id,
                                         incident_id=plan.incident_id, strategy="S2",
                                         action="apply", microbatches=microbatches,
                                         gpu_of_rank=None, swaps=[], cost_s=0.5,
                                         summary="test")))
            await session.commit()


def api_settings(nats_url: str, db_url: str, tmp_path: Path, **over: Any) -> Settings:
    base: dict[str, Any] = {"nats_url": nats_url, "database_url": db_url,
                            "data_dir": tmp_path / "data", "webhook_key": WEBHOOK_KEY,
                            "token_key": TOKEN_KEY, "webhook_timeout_s": 2.0,
                            # the tests' receivers listen on loopback, which webhooks may not
                            # reach unless allowed
                            "webhook_allow_hosts": "127.0.0.1"}
    base.update(over)
    return Settings(**base)


@pytest.fixture()
async def api(bus: Bus, fresh_db_url: str, tmp_path: Path) -> AsyncIterator[Api]:
    settings = api_settings(bus.url, fresh_db_url, tmp_path)
    ctx = await start_service("api", settings, backends=bus.backends("api", fresh_db_url))
    app = create_app(ctx.db(), settings=settings, api=ApiSettings(), nc=ctx.nc, js=ctx.js)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api")
    a = Api(ctx, app, client, bus=bus)
    for role in ROLES:
        a.tokens[role] = await a.token(role, f"{role}-user",
                                       job_id=JOB_OF_JOB_TOKEN if role == "job" else None)
    try:
        yield a
    finally:
        await client.aclose()
        await ctx.close()


def recent(minutes: float = 0) -> str:
    return (datetime.now(UTC) - timedelta(minutes=minutes)).isoformat()
