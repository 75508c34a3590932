"""Probes and metrics: /healthz always, /readyz with NATS and Postgres, /metrics computed from
the database and JetStream."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from services.api.app import create_app
from services.api.settings import ApiSettings
from services.common.db import repository as repo
from services.common.db.documents import Evidence, Validation
from services.common.db.session import make_engine, make_sessionmaker
from tests.conftest import Bus
from tests.services.api.conftest import Api, api_settings
from tests.services.notifier.receiver import free_port


async def test_readyz_names_what_is_missing(api: Api, bus: Bus, fresh_db_url: str,
                                            tmp_path: Path) -> None:
    r = await api.client.get("/readyz")
    assert r.status_code == 200 and r.json() == {"status": "ready",
                                                 "checks": {"database": "ok", "nats": "ok"}}
    no_bus = create_app(api.ctx.db(), settings=api_settings(bus.url, fresh_db_url, tmp_path),
                        api=ApiSettings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=no_bus),
                                 base_url="http://a") as c:
        r = await c.get("/readyz")
        assert r.status_code == 503 and r.json()["checks"]["nats"] == "not configured"
        assert (await c.get("/healthz")).json() == {"status": "ok"}


async def test_readyz_says_what_failed_not_where(api: Api, bus: Bus, fresh_db_url: str,
                                                tmp_path: Path) -> None:
    """An open route: a database that does not answer is "unreachable", without the driver's
    text (which named the host, its address and port)."""
    port = free_port()  # nothing listens there
    engine = make_engine(f"postgresql://postgres@127.0.0.1:{port}/greyhound")
    down = create_app(make_sessionmaker(engine), settings=api_settings(
        bus.url, fresh_db_url, tmp_path), api=ApiSettings(), nc=api.ctx.nc, js=api.ctx.js)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=down),
                                     base_url="http://a") as c:
            r = await c.get("/readyz")
    finally:
        await engine.dispose()
    assert r.status_code == 503, r.text
    assert r.json()["checks"] == {"database": "unreachable", "nats": "ok"}
    assert "127.0.0.1" not in r.text and str(port) not in r.text


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_metrics_from_database_and_jetstream(api: Api) -> None:
    await api.job("job-m", world_size=16)
    await api.incident("job-m", before_s=1.0, after_s=2.0, stages=("localized",),
                       evidence=Evidence(validation=Validation(suspicion="s1", verdict="compute_slow",
                                                               pause_s=3.0)))
    await api.incident("job-m", kind="hang_hardware", before_s=0.0, after_s=90.0)
    async with api.ctx.db()() as session:
        hook = await repo.create_webhook(session, name="m", url="http://127.0.0.1:9/", secret_enc="x",
                                         events=[], format="json", created_by="t")
        d = await repo.enqueue_delivery(session, webhook_id=hook.id, event_id="k1", event="e",
                                        incident_id=None, payload={}, due=hook.created_at)
        assert d is not None
        from datetime import UTC, datetime

        for outcome in ("timeout", "delivered"):
            await repo.record_attempt(session, d, outcome=outcome, status_code=None, error=None,
                                      duration_ms=1.0, final_status="delivered",
                                      next_attempt_at=None, at=datetime.now(UTC))
        await session.commit()
    await api.client.get("/v1/incidents", headers=api.auth("viewer"))
    r = await api.client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = _samples(r.text)
    assert m[("greyhound_metrics_source_up", (("source", "database"),))] == 1
    assert m[("greyhound_metrics_source_up", (("source", "nats"),))] == 1
    assert m[("greyhound_incidents", (("kind", "slowdown"), ("state", "localized")))] == 1
    assert m[("greyhound_incidents", (("kind", "hang_hardware"), ("state", "detected")))] == 1
    # Slowdown: 4 iterations x 2 s before detection; hang: stalled 90 s when raised.
    assert m[("greyhound_detection_latency_seconds_count", ())] == 2
    assert m[("greyhound_detection_latency_seconds_bucket", (("le", "10.0"),))] == 1
    assert m[("greyhound_detection_latency_seconds_bucket", (("le", "120.0"),))] == 2
    assert abs(m[("greyhound_detection_latency_seconds_sum", ())] - 98.0) < 0.01
    assert m[("greyhound_localization_latency_seconds_count", ())] == 1
    assert m[("greyhound_validation_pause_seconds_count", ())] == 1
    assert m[("greyhound_validation_pause_seconds_sum", ())] == 3.0
    assert m[("greyhound_gpu_hours_lost", (("kind", "hang_hardware"),))] > 16 * 90 / 3600 * 0.99
    assert m[("greyhound_webhook_attempts_total", (("outcome", "timeout"),))] == 1
    assert m[("greyhound_webhook_attempts_total", (("outcome", "delivered"),))] == 1
    assert m[("greyhound_webhook_deliveries", (("state", "delivered"),))] == 1
    assert ("greyhound_bus_messages_total", (("stream", "GH_EVENTS"),)) in m
    assert any(k[0] == "greyhound_api_requests_total" and ("route", "/v1/incidents") in k[1]
               for k in m)


async def test_a_probe_that_times_out_answers_503_and_leaves_the_api_usable(
        api: Api, bus: Bus, fresh_db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A database that takes longer than the probe's 2 s to answer (its ping made a 5 s
    query): /readyz says so, and the API answers the next requests. The probe's query was
    cancelled on the request's own session, whose commit then failed: a 500 instead of the
    503, and a connection cut mid-operation left to the request's cleanup."""
    slow = {"on": False}
    real_ping = repo.ping

    async def ping(session: AsyncSession) -> None:
        if slow["on"]:
            await session.execute(text("select pg_sleep(5)"))
        await real_ping(session)

    monkeypatch.setattr(repo, "ping", ping)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api.app),
                                 base_url="http://a") as c:
        slow["on"] = True
        r = await c.get("/readyz")
        assert r.status_code == 503 and r.json()["checks"]["database"] == "unreachable", r.text
        slow["on"] = False
        for _ in range(3):
            assert (await c.get("/readyz")).status_code == 200
            assert (await c.get("/v1/incidents", headers=api.auth("viewer"))).status_code == 200
    failed = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not failed, failed
