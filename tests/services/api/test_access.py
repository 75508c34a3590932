"""The role matrix on every route: no token 401, a weaker role 403, the required role (and, for
reads, every stronger one) succeeds. Routes and their roles come from the OpenAPI document, so
a new route is covered (or fails here for lack of a declared role) without editing this test."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from services.api.tokens import ROLES, at_least
from tests.conftest import Bus
from tests.services.api.conftest import Api, api_settings

CLOSED_PORT_URL = "http://127.0.0.1:9/hook"  # discard port: nothing listens on loopback


async def _targets(api: Api) -> dict[str, str]:
    await api.job("job-a")
    ids = {"job_id": "job-a"}
    for name in ("read", "ack", "close", "plan_read"):
        ids[f"incident_{name}"] = await api.incident("job-a")
    for name in ("read", "approve", "reject", "delivered"):  # one open plan per incident and strategy
        incident = ids["incident_plan_read"] if name == "read" else await api.incident("job-a")
        ids[f"plan_{name}"] = await api.plan(incident, "job-a")
    await api.deliver(ids["plan_delivered"], "job-a", version=1, microbatches=[2, 1, 1])
    for name in ("read", "test", "delete"):
        r = await api.client.post("/v1/webhooks", headers=api.auth("admin"),
                                  json={"name": name, "url": CLOSED_PORT_URL})
        assert r.status_code == 201, r.text
        ids[f"webhook_{name}"] = r.json()["id"]
    r = await api.client.post("/v1/tokens", headers=api.auth("admin"),
                              json={"name": "to-revoke", "role": "viewer"})
    ids["token_id"] = r.json()["id"]
    return ids


def _fill(path: str, method: str, ids: dict[str, str]) -> str:
    incident = {"/ack": ids["incident_ack"], "/close": ids["incident_close"]}
    plan = {"/approve": ids["plan_approve"], "/reject": ids["plan_reject"]}
    webhook = {"/test": ids["webhook_test"]}
    tail = "/" + path.rsplit("/", 1)[1]
    return (path.replace("{job_id}", ids["job_id"])
            .replace("{incident_id}", incident.get(tail, ids["incident_read"]))
            .replace("{plan_id}", plan.get(tail, ids["plan_read"]))
            .replace("{webhook_id}", webhook.get(tail, ids["webhook_delete"] if method == "delete"
                                                 else ids["webhook_read"]))
            .replace("{token_id}", ids["token_id"]))


BODIES: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/v1/incidents/{incident_id}/close"): {"note": "fixed by hand"},
    ("post", "/v1/webhooks"): {"url": CLOSED_PORT_URL},
    ("post", "/v1/tokens"): {"name": "made-by-matrix", "role": "viewer"},
    ("put", "/v1/jobs/{job_id}/layout"): {"tp": 1, "dp": 2, "pp": 2, "gpus_per_node": 2,
                                          "microbatches": 8},
    ("post", "/v1/jobs/{job_id}/plan/applied"): {"version": 1, "cost_s": 0.5},
}


async def test_every_route_enforces_its_role(api: Api) -> None:
    ids = await _targets(api)
    spec = api.app.openapi()
    checked = 0
    for path, item in spec["paths"].items():
        for method, op in item.items():
            if not path.startswith("/v1/"):
                assert "x-required-role" not in op
                continue
            need = op.get("x-required-role")
            assert need in ROLES, f"{method.upper()} {path} declares no role"
            url = _fill(path, method, ids)
            body = BODIES.get((method, path), {} if method == "post" else None)

            async def call(headers: dict[str, str], url: str = url, method: str = method,
                           body: dict[str, Any] | None = body) -> Any:
                return await api.client.request(method.upper(), url, headers=headers, json=body)

            r = await call({})
            assert r.status_code == 401, (method, path, r.status_code, r.text)
            assert r.headers["content-type"] == "application/problem+json"
            assert r.headers["www-authenticate"].startswith("Bearer")
            r = await call({"Authorization": "Bearer gh_not-a-real-token"})
            assert r.status_code == 401, (method, path)
            for role in ROLES:
                if at_least(role, need):
                    continue
                r = await call(api.auth(role))
                assert r.status_code == 403, (method, path, role, r.status_code)
                assert r.json()["status"] == 403 and need in r.json()["detail"]
            allowed = [need] if method != "get" else [r for r in ROLES if at_least(r, need)]
            for role in allowed:
                r = await call(api.auth(role))
                assert 200 <= r.status_code < 300, (method, path, role, r.status_code, r.text)
            checked += 1
    assert checked >= 26


async def test_probes_and_metrics_are_open(api: Api) -> None:
    for path in ("/healthz", "/readyz", "/metrics"):
        r = await api.client.get(path)
        assert r.status_code == 200, (path, r.text)


async def test_expired_and_revoked_tokens_are_refused(api: Api) -> None:
    old = await api.token("admin", "expired", expires_at=datetime.now(UTC) - timedelta(seconds=1))
    r = await api.client.get("/v1/me", headers={"Authorization": f"Bearer {old}"})
    assert r.status_code == 401 and "expired" in r.json()["detail"]
    made = (await api.client.post("/v1/tokens", headers=api.auth("admin"),
                                  json={"name": "short-lived", "role": "operator"})).json()
    bearer = {"Authorization": f"Bearer {made['token']}"}
    me = (await api.client.get("/v1/me", headers=bearer)).json()
    assert me == {"name": "short-lived", "role": "operator", "token_id": made["id"],
                  "job_id": None}
    assert (await api.client.delete(f"/v1/tokens/{made['id']}",
                                    headers=api.auth("admin"))).status_code == 204
    assert (await api.client.get("/v1/me", headers=bearer)).status_code == 401
    again = await api.client.delete(f"/v1/tokens/{made['id']}", headers=api.auth("admin"))
    assert again.status_code == 409
    listed = (await api.client.get("/v1/tokens", headers=api.auth("admin"))).json()
    assert made["id"] not in {t["id"] for t in listed}
    assert all("token" not in t and "token_hash" not in t for t in listed)


async def test_every_change_is_audited(api: Api) -> None:
    await api.job("job-b")
    inc = await api.incident("job-b")
    await api.client.post(f"/v1/incidents/{inc}/ack", headers=api.auth("operator"),
                          json={"note": "on it"})
    await api.client.post(f"/v1/incidents/{inc}/close", headers=api.auth("operator"),
                          json={"note": "replaced the GPU"})
    rows = (await api.client.get("/v1/audit", headers=api.auth("admin"))).json()
    mine = [(a["actor"], a["action"], a["note"]) for a in rows if a["target_id"] == inc]
    assert mine == [("operator-user", "incident.close", "replaced the GPU"),
                    ("operator-user", "incident.ack", "on it")]


async def test_anonymous_viewer_only_when_configured(api: Api, bus: Bus, fresh_db_url: str,
                                                     tmp_path: Any) -> None:
    import httpx

    from services.api.app import create_app
    from services.api.settings import ApiSettings

    settings = api_settings(bus.url, fresh_db_url, tmp_path)
    app = create_app(api.ctx.db(), settings=settings,
                     api=ApiSettings(api_anonymous_role="viewer", api_metrics_public=False))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://a") as c:
        assert (await c.get("/v1/incidents")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200  # anonymous is a viewer here
        assert (await c.post("/v1/incidents/x/ack", json={})).status_code == 403
    strict = create_app(api.ctx.db(), settings=settings,
                        api=ApiSettings(api_metrics_public=False))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=strict),
                                 base_url="http://a") as c:
        assert (await c.get("/metrics")).status_code == 401
        assert (await c.get("/metrics", headers=api.auth("viewer"))).status_code == 200
