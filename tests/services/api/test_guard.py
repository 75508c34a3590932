"""What every request passes through: a body too large is a 413 (by its Content-Length, or as
it streams in without one), a client past its pace a 429, failed logins are logged and a
client that keeps failing is answered 429; the dashboard carries a Content-Security-Policy
and refuses framing; no Swagger UI (it came from a CDN into this origin), the OpenAPI stays."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from services.api.app import create_app
from services.api.settings import ApiSettings
from tests.conftest import Bus
from tests.services.api.conftest import Api, api_settings

BIG = 20 * 1024 * 1024


async def test_a_20_mb_body_is_refused_before_it_is_read(api: Api) -> None:
    job = api.auth("job")
    r = await api.client.put("/v1/jobs/job-a/layout", headers=job, content=b" " * BIG)
    assert r.status_code == 413 and r.headers["content-type"] == "application/problem+json"

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it comes
        for _ in range(BIG // 65536):
            yield b" " * 65536

    r = await api.client.put("/v1/jobs/job-a/layout", headers=job, content=chunks())
    assert r.status_code == 413, r.text
    ok = await api.client.put("/v1/jobs/job-a/layout", headers=job, json={
        "tp": 1, "dp": 2, "pp": 1, "gpus_per_node": 2, "microbatches": 2})
    assert ok.status_code == 200, ok.text


async def test_the_dashboard_has_a_policy_and_no_frame(api: Api) -> None:
    r = await api.client.get("/dashboard/")
    assert r.status_code == 200
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert r.headers["x-frame-options"] == "DENY"
    assert r.headers["x-content-type-options"] == "nosniff"
    assert (await api.client.get("/docs")).status_code == 404
    assert (await api.client.get("/redoc")).status_code == 404
    assert (await api.client.get("/openapi.json")).status_code == 200
    v1 = await api.client.get("/v1/me", headers=api.auth("viewer"))
    assert v1.headers["x-frame-options"] == "DENY"


async def test_failed_logins_are_logged_and_limited(api: Api, bus: Bus, fresh_db_url: str,
                                                    tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    app = create_app(api.ctx.db(), settings=api_settings(bus.url, fresh_db_url, tmp_path),
                     api=ApiSettings(api_auth_failures_per_min=5))
    caplog.set_level(logging.WARNING, logger="services.api.auth")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://a") as c:
        bad = {"Authorization": "Bearer gh_not-a-token-of-ours"}
        codes = [(await c.get("/v1/me", headers=bad)).status_code for _ in range(7)]
        assert codes[:5] == [401] * 5 and codes[5:] == [429, 429], codes
        limited = await c.get("/v1/me", headers=api.auth("viewer"))  # this client, any token
        assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
    logged = [r.getMessage() for r in caplog.records if "failed login" in r.getMessage()]
    assert len(logged) == 5 and "GET /v1/me" in logged[0] and "gh_not-a-t" in logged[0]


async def test_a_client_past_its_pace_is_told_to_wait(api: Api, bus: Bus, fresh_db_url: str,
                                                      tmp_path: Path) -> None:
    app = create_app(api.ctx.db(), settings=api_settings(bus.url, fresh_db_url, tmp_path),
                     api=ApiSettings(api_rate_per_s=0.5, api_rate_burst=3))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://a") as c:
        codes = [(await c.get("/healthz")).status_code for _ in range(4)]
    assert codes == [200, 200, 200, 429], codes
