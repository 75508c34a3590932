"""A job's own routes: its layout, the plan it must run now, its reports (handed to the planner
over the bus); and the decision routes' additions: expired proposals refused, decisions on the
incident's timeline."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from services.common.bus.contract import PlanReport, Subjects
from services.common.bus.streams import EVENTS
from services.common.db import repository as repo
from services.common.db.models import Plan
from tests.services.api.conftest import Api
from tests.services.common.support import stored


async def test_layout_is_declared_by_the_job_and_checked(api: Api) -> None:
    job = await api.job_token("new-job")
    layout = {"tp": 2, "dp": 4, "pp": 2, "gpus_per_node": 8, "microbatches": 16,
              "multiple_of": 2}
    r = await api.client.put("/v1/jobs/new-job/layout", headers=job, json=layout)
    assert r.status_code == 200, r.text
    detail = (await api.client.get("/v1/jobs/new-job", headers=api.auth("viewer"))).json()
    assert detail["topology"]["layout"] == {**layout}
    bad = [{**layout, "microbatches": 7},  # not a multiple of 2
           {**layout, "gpus_per_node": 3},  # does not divide 16 GPUs
           {**layout, "tp": 0}, {**layout, "colour": "red"}]
    for body in bad:
        r = await api.client.put("/v1/jobs/new-job/layout", headers=job, json=body)
        assert r.status_code == 422, (body, r.text)
    r = await api.client.put("/v1/jobs/bad%20id/layout", headers=api.auth("operator"),
                             json=layout)
    assert r.status_code == 422 and "job id" in r.json()["detail"]
    assert (await api.client.put("/v1/jobs/new-job/layout", headers=api.auth("viewer"),
                                 json=layout)).status_code == 403


async def test_current_plan_and_a_report_reach_the_planner_once(api: Api) -> None:
    await api.job("job-r")
    r = await api.client.get("/v1/jobs/job-r/plan", headers=api.auth("viewer"))
    assert r.json()["version"] == 0 and r.json()["microbatches"] is None
    assert (await api.client.get("/v1/jobs/nope/plan",
                                 headers=api.auth("viewer"))).status_code == 404
    plan = await api.plan(await api.incident("job-r"), "job-r")
    await api.deliver(plan, "job-r", version=1, microbatches=[5, 3])
    body = (await api.client.get("/v1/jobs/job-r/plan", headers=api.auth("viewer"))).json()
    assert (body["version"], body["plan_id"], body["microbatches"], body["action"]) == (
        1, plan, [5, 3], "apply")
    job = await api.job_token("job-r")
    assert (await api.client.post("/v1/jobs/job-r/plan/applied", headers=job,
                                  json={"version": 2})).status_code == 404
    r = await api.client.post("/v1/jobs/job-r/plan/applied", headers=job,
                              json={"version": 1, "cost_s": 0.25})
    assert r.status_code == 202, r.text
    sent = await _reports(api, "job-r")
    assert [(m.version, m.outcome, m.cost_s, m.reporter) for m in sent] == [
        (1, "applied", 0.25, "job-user")]
    assert sent[0].event_id == r.json()["event_id"]
    async with api.ctx.db()() as session:  # the planner recorded it
        d = await repo.get_delivery(session, "job-r", 1, for_update=True)
        assert d is not None
        d.outcome = "applied"
        await session.commit()
    again = await api.client.post("/v1/jobs/job-r/plan/applied", headers=job, json={"version": 1})
    assert again.status_code == 409 and "already" in again.json()["detail"]
    assert (await api.client.post("/v1/jobs/job-r/plan/applied", headers=job,
                                  json={"version": 1, "outcome": "done"})).status_code == 422


async def test_a_job_token_acts_for_its_own_job_only(api: Api) -> None:
    """Job A's token on job B's layout and plan report: 403, nothing recorded or sent. A job
    token made before tokens named their job acts for none; an operator acts for any job."""
    await api.job("job-b")
    plan = await api.plan(await api.incident("job-b"), "job-b")
    await api.deliver(plan, "job-b", version=1, microbatches=[5, 3])
    layout = {"tp": 1, "dp": 2, "pp": 1, "gpus_per_node": 2, "microbatches": 2}
    unscoped = await api.token("job", "old-job-token")  # as migration 0006 leaves one
    for headers in (api.auth("job"), {"Authorization": f"Bearer {unscoped}"}):
        r = await api.client.put("/v1/jobs/job-b/layout", headers=headers, json=layout)
        assert r.status_code == 403 and "not for job 'job-b'" in r.json()["detail"], r.text
        r = await api.client.post("/v1/jobs/job-b/plan/applied", headers=headers,
                                  json={"version": 1, "outcome": "failed", "error": "forged"})
        assert r.status_code == 403, r.text
    detail = (await api.client.get("/v1/jobs/job-b", headers=api.auth("viewer"))).json()
    assert detail["topology"]["layout"]["dp"] == 4  # the seeded layout, untouched
    assert await _reports(api, "job-b") == []
    r = await api.client.put("/v1/jobs/job-b/layout", headers=api.auth("operator"), json=layout)
    assert r.status_code == 200, r.text
    me = (await api.client.get("/v1/me", headers=api.auth("job"))).json()
    assert me["job_id"] == "job-a"
    admin = api.auth("admin")
    for body in ({"name": "j", "role": "job"}, {"name": "v", "role": "viewer", "job_id": "job-a"},
                 {"name": "k", "role": "job", "job_id": "bad id"}):
        r = await api.client.post("/v1/tokens", headers=admin, json=body)
        assert r.status_code == 422, (body, r.text)
    made = await api.client.post("/v1/tokens", headers=admin,
                                 json={"name": "b", "role": "job", "job_id": "job-b"})
    assert made.status_code == 201 and made.json()["job_id"] == "job-b"
    r = await api.client.post("/v1/jobs/job-b/plan/applied", json={"version": 1},
                              headers={"Authorization": f"Bearer {made.json()['token']}"})
    assert r.status_code == 202, r.text


async def test_an_expired_proposal_cannot_be_decided_and_decisions_reach_the_timeline(
        api: Api) -> None:
    await api.job("job-x")
    inc = await api.incident("job-x")
    old, fresh = await api.plan(inc, "job-x"), await api.plan(inc, "job-x", strategy="S3")
    async with api.ctx.db()() as session:
        row = await session.get(Plan, old)
        assert row is not None
        row.expires_at = datetime.now(UTC) - timedelta(seconds=1)
        await session.commit()
    op = api.auth("operator")
    r = await api.client.post(f"/v1/plans/{old}/approve", headers=op, json={})
    assert r.status_code == 409 and "expired" in r.json()["detail"]
    r = await api.client.post(f"/v1/plans/{fresh}/reject", headers=op, json={"note": "not now"})
    assert r.status_code == 200
    timeline = (await api.client.get(f"/v1/incidents/{inc}", headers=op)).json()["timeline"]
    assert [(e["stage"], e["detail"].get("by"), e["detail"].get("note")) for e in timeline][-1] == (
        "plan_rejected", "operator-user", "not now")


async def _reports(api: Api, job: str) -> list[PlanReport]:
    nc = await api.operator()
    try:
        return [PlanReport.model_validate_json(d)
                for d in await stored(nc.jetstream(), EVENTS, Subjects.plan_report(job))]
    finally:
        await nc.close()
