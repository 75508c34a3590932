"""Plan decisions: approve or reject a proposed plan once; anything else is a 409."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from sqlalchemy import select

from services.common.db.models import Plan, WebhookDelivery
from tests.services.api.conftest import Api


async def test_approve_then_conflicts(api: Api) -> None:
    await api.job("job-p")
    inc = await api.incident("job-p")
    plan = await api.plan(inc, "job-p")
    other = await api.plan(inc, "job-p", strategy="S3")
    hook = await api.client.post("/v1/webhooks", headers=api.auth("admin"),
                                 json={"url": "http://127.0.0.1:9/x", "events": ["plan.approved"]})
    assert hook.status_code == 201
    op = api.auth("operator")
    r = await api.client.post(f"/v1/plans/{plan}/approve", headers=op, json={"note": "go"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "approved"
    assert [(a["decision"], a["approver"], a["comment"]) for a in body["approvals"]] == [
        ("approve", "operator-user", "go")]
    assert (await api.client.post(f"/v1/plans/{plan}/approve", headers=op,
                                  json={})).status_code == 409
    assert (await api.client.post(f"/v1/plans/{plan}/reject", headers=op,
                                  json={})).status_code == 409
    r = await api.client.post(f"/v1/plans/{other}/reject", headers=op, json={"note": "no"})
    assert r.json()["status"] == "rejected"
    async with api.ctx.db()() as session:
        rows = (await session.scalars(select(WebhookDelivery))).all()
    # Only the approval: the webhook did not ask for plan.rejected.
    assert [(d.event, d.event_id, d.payload["plan"]["decided_by"]) for d in rows] == [
        ("plan.approved", f"{plan}.approved", "operator-user")]
    listed = (await api.client.get("/v1/plans", headers=api.auth("viewer"),
                                   params={"incident_id": inc})).json()
    assert {p["id"]: p["status"] for p in listed} == {plan: "approved", other: "rejected"}
    assert (await api.client.post("/v1/plans/none/approve", headers=op,
                                  json={})).status_code == 404


async def test_two_operators_at_once_get_one_decision(api: Api) -> None:
    await api.job("job-q")
    plan = await api.plan(await api.incident("job-q"), "job-q")
    second = await api.token("operator", "bob")
    calls = [api.client.post(f"/v1/plans/{plan}/approve", headers=api.auth("operator"), json={}),
             api.client.post(f"/v1/plans/{plan}/reject",
                             headers={"Authorization": f"Bearer {second}"}, json={})]
    codes = sorted(r.status_code for r in await asyncio.gather(*calls))
    assert codes == [200, 409]


async def test_the_decision_is_on_the_plan_and_on_its_incidents_audit_trail(api: Api) -> None:
    await api.job("job-r")
    inc = await api.incident("job-r")
    plan = await api.plan(inc, "job-r", strategy="S3")
    async with api.ctx.db()() as session:
        row = await session.get(Plan, plan)
        assert row is not None
        row.expires_at = datetime.now(UTC) + timedelta(minutes=15)
        await session.commit()
    v = api.auth("viewer")
    proposed = (await api.client.get(f"/v1/plans/{plan}", headers=v)).json()
    assert proposed["decided_by"] is None and 800 < proposed["expires_in_s"] <= 900
    r = await api.client.post(f"/v1/plans/{plan}/approve", headers=api.auth("operator"),
                              json={"note": "swap them"})
    assert r.status_code == 200 and r.json()["decided_by"] == "operator-user"
    assert r.json()["expires_in_s"] is None
    listed = (await api.client.get("/v1/plans", headers=v, params={"job_id": "job-r"})).json()
    assert [p["decided_by"] for p in listed] == ["operator-user"]
    await api.deliver(plan, "job-r")
    applied = await api.client.post("/v1/jobs/job-r/plan/applied", headers=await api.job_token("job-r"),
                                    json={"version": 1, "cost_s": 0.5})
    assert applied.status_code == 202, applied.text
    await api.client.post(f"/v1/incidents/{inc}/ack", headers=api.auth("operator"), json={})
    detail = (await api.client.get(f"/v1/incidents/{inc}", headers=v)).json()
    assert [(a["action"], a["target_type"], a["actor"]) for a in detail["audit"]] == [
        ("incident.ack", "incident", "operator-user"), ("plan.report", "plan", "job-user"),
        ("plan.approve", "plan", "operator-user")]
    assert detail["plans"][0]["decided_by"] == "operator-user"


async def test_a_form_body_is_a_422_that_names_the_content_type(api: Api) -> None:
    """What curl -d sends without -H 'Content-Type: application/json'."""
    await api.job("job-s")
    plan = await api.plan(await api.incident("job-s"), "job-s")
    r = await api.client.post(f"/v1/plans/{plan}/approve", headers={
        **api.auth("operator"), "Content-Type": "application/x-www-form-urlencoded"},
        content=b'{"note": "go"}')
    assert r.status_code == 422
    assert "Content-Type: application/json" in r.json()["detail"]
    assert "application/x-www-form-urlencoded" in r.json()["detail"]
