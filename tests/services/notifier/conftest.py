"""The notifier on its own NATS server (its durable consumer starts empty) and a fresh database."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from services.common.bus.client import BusClient, publish
from services.common.bus.contract import IncidentEvent, Subjects
from services.common.db import repository as repo
from services.common.db.documents import Culprit, Detection, Evidence
from services.common.runtime import ServiceContext, start_service
from services.common.settings import Settings
from services.common.webhooks.secretbox import SecretBox
from services.notifier.service import Notifier, run_notifier
from services.notifier.settings import NotifierSettings
from tests.conftest import Bus

KEY = "notifier-test-key-0123456789abcdef"


def notifier_settings(nats: str, db: str, tmp: Path, **over: object) -> Settings:
    values: dict[str, object] = {
        "nats_url": nats, "database_url": db, "data_dir": tmp / "data", "webhook_key": KEY,
        "webhook_timeout_s": 2.0, "api_public_url": "http://127.0.0.1:8000/dashboard",
        "webhook_allow_hosts": "127.0.0.1"}  # the test receiver's loopback, allowed
    values.update(over)
    return Settings(**values)


# Quick retries and polls, so that a test sees several attempts within seconds.
FAST = NotifierSettings(webhook_backoff_base_s=0.2, webhook_backoff_max_s=1.0,
                        notifier_poll_s=0.05, webhook_max_attempts=12)


@dataclass
class Running:
    ctx: ServiceContext
    notifier: Notifier
    box: SecretBox
    analyzer: BusClient  # announces incidents, as the analyzer does

    async def webhook(self, url: str, secret: str, *, events: list[str] | None = None,
                      fmt: str = "json") -> str:
        async with self.ctx.db()() as session:
            hook = await repo.create_webhook(session, name="oncall", url=url,
                                             secret_enc=self.box.encrypt(secret),
                                             events=events or [], format=fmt, created_by="test")
            await session.commit()
            return hook.id

    async def incident(self, job: str, *, world_size: int = 8,
                       suspected: repo.Moment | None = None,
                       confirmed: repo.Moment | None = None) -> str:
        """A slowdown incident of ``job`` on rank 2; with ``suspected`` one the tracker
        suspected (and, with ``confirmed`` too, already confirmed)."""
        async with self.ctx.db()() as session:
            await repo.touch_job(session, job, world_size=world_size)
            inc = await repo.open_incident(
                session, job_id=job, kind="slowdown", dedup_key="slowdown", severity=1.5,
                summary=f"job {job} slowdown: iteration 1.000s -> 1.500s (1.50x)",
                culprit=Culprit(ranks=[2]), evidence=Evidence(),
                stage_detail=Detection(event_id=uuid.uuid4().hex, ranks=[2], method="bocd-v",
                                       first_iteration=10, detected_iteration=12,
                                       before_s=1.0, after_s=1.5),
                suspected=suspected, confirmed=confirmed)
            await session.commit()
            return inc.id

    async def announce(self, job: str, incident_id: str, stage: str = "detected",
                       event_id: str | None = None) -> IncidentEvent:
        ev = IncidentEvent(job_id=job, incident_id=incident_id, stage=stage,
                           kind="slowdown", severity=1.5, summary=f"job {job} slowdown",
                           **({"event_id": event_id} if event_id else {}))
        await publish(self.analyzer.jetstream(), Subjects.incident(job), ev)
        return ev


@pytest.fixture()
async def running(own_bus: Bus, fresh_db_url: str, tmp_path: Path) -> AsyncIterator[Running]:
    settings = notifier_settings(own_bus.url, fresh_db_url, tmp_path)
    ctx = await start_service("notifier", settings,
                              backends=own_bus.backends("notifier", fresh_db_url))
    analyzer = await own_bus.connect("analyzer")
    box = SecretBox(KEY)
    notifier = Notifier(ctx, box, FAST, rng=random.Random(7))
    stop = asyncio.Event()
    task = asyncio.create_task(run_notifier(ctx, stop, notifier=notifier))
    try:
        yield Running(ctx, notifier, box, analyzer)
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
        await analyzer.close()
        await ctx.close()


async def until(pred: Callable[[], Any], timeout_s: float = 30.0, what: str = "condition") -> None:
    """Poll an async or plain predicate; generous bounds for a loaded 2-core machine."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        value = pred()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
