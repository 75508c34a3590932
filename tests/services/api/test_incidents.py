"""Incidents over REST: filters, paging, detail with cost and audit, acknowledge and close."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from services.common.bus.contract import IncidentEvent, Subjects
from services.common.db import repository as repo
from services.common.db.documents import Detection, Evidence, PlanStep, Validation
from tests.services.api.conftest import Api


async def test_filters_and_paging(api: Api) -> None:
    await api.job("job-f", world_size=8)
    await api.job("job-g")
    slow = [await api.incident("job-f") for _ in range(3)]
    hang = await api.incident("job-g", kind="hang_not_entered", after_s=70.0, before_s=0.0)
    done = await api.incident("job-g", stages=("resolved",))
    v = api.auth("viewer")

    async def ids(**params: object) -> tuple[list[str], int]:
        r = await api.client.get("/v1/incidents", headers=v, params=params)
        assert r.status_code == 200, r.text
        return [i["id"] for i in r.json()], int(r.headers["x-total-count"])

    assert (await ids(job_id="job-f"))[0] == slow[::-1]  # newest first
    page, total = await ids(job_id="job-f", limit=2, offset=1)
    assert page == slow[::-1][1:3] and total == 3
    assert (await ids(kind="hang*"))[0] == [hang]
    assert (await ids(job_id="job-g", status="open"))[0] == [hang]
    assert (await ids(job_id="job-g", status="resolved"))[0] == [done]
    future = (datetime.now(UTC) + timedelta(minutes=1)).isoformat()
    past = (datetime.now(UTC) - timedelta(minutes=5)).isoformat()
    assert (await ids(opened_after=future))[1] == 0
    assert (await ids(opened_after=past, opened_before=future))[1] == 5
    bad = await api.client.get("/v1/incidents", headers=v, params={"status": "nope"})
    assert bad.status_code == 422 and bad.headers["content-type"] == "application/problem+json"
    assert bad.json()["errors"][0]["loc"] == ["query", "status"]
    naive = await api.client.get("/v1/incidents", headers=v,
                                 params={"opened_after": "2026-01-01T00:00:00"})
    assert naive.status_code == 422 and "time zone" in naive.json()["detail"]


async def test_detail_has_timeline_evidence_and_cost(api: Api) -> None:
    await api.job("job-c", world_size=8)
    inc = await api.incident("job-c", before_s=1.0, after_s=1.5, evidence=Evidence(validation=Validation(
        suspicion="s1", verdict="compute_slow", pause_s=1.2)), stages=("localized",))
    r = await api.client.get(f"/v1/incidents/{inc}", headers=api.auth("viewer"))
    body = r.json()
    assert [e["stage"] for e in body["timeline"]] == ["detected", "localized"]
    assert body["evidence"]["validation"]["verdict"] == "compute_slow"
    cost = body["cost"]
    # 4 slow iterations of 1.5 s before detection; a third of 8 GPUs lost since then.
    assert cost["gpus"] == 8 and abs(cost["slowdown"] - 1.5) < 1e-9
    assert abs(cost["lost_fraction"] - 1 / 3) < 1e-9
    assert abs(cost["detection_latency_s"] - 6.0) < 1e-6 and cost["ongoing"] is True
    assert cost["duration_s"] >= 6.0
    expected = 8 * (1 / 3) * cost["duration_s"] / 3600
    assert abs(cost["gpu_hours_lost"] - expected) < 1e-3
    missing = await api.client.get("/v1/incidents/nope", headers=api.auth("viewer"))
    assert missing.status_code == 404
    assert missing.json() == {"type": "urn:greyhound:problem:not-found", "title": "Not Found",
                              "status": 404, "detail": "incident 'nope' not found",
                              "instance": "/v1/incidents/nope"}


async def test_a_mitigated_incident_keeps_its_cost(api: Api) -> None:
    """After a plan, the tracker's newest detection is the speed-up the plan brought (after_s <
    before_s): the incident's cost, and the metric, must still count the slow time before it."""
    await api.job("job-p", world_size=16)
    inc = await api.incident("job-p", kind="comm_slow", before_s=0.4, after_s=1.2,
                             stages=("localized", "validated"))
    async with api.ctx.db()() as session:
        row = await repo.get_incident_for_update(session, inc)
        assert row is not None
        await repo.add_timeline(session, row, "mitigated",
                                PlanStep(plan_id="p1", strategy="S2", cost_s=0.5))
        await session.commit()
    await asyncio.sleep(0.2)
    async with api.ctx.db()() as session:
        row = await repo.get_incident_for_update(session, inc)
        assert row is not None
        await repo.add_timeline(session, row, "detected", Detection(
            event_id="partial-1", ranks=[0], method="bocd-v", before_s=1.2, after_s=0.5,
            first_iteration=300, detected_iteration=300, change="partial"))
        await session.commit()
    await asyncio.sleep(0.2)
    r = await api.client.get(f"/v1/incidents/{inc}", headers=api.auth("viewer"))
    cost = r.json()["cost"]
    # at least the 4 congested iterations of 1.2 s before the detection: 2/3 of 16 GPUs lost
    floor = 16 * (1 - 0.4 / 1.2) * 4 * 1.2 / 3600
    assert cost["gpu_hours_lost"] > floor and cost["lost_fraction"] > 0.1
    assert abs(cost["slowdown"] - 0.5 / 0.4) < 1e-9 and abs(cost["peak_slowdown"] - 3.0) < 1e-9
    assert cost["mitigated_at"] is not None and cost["gpu_hours_saved"] is not None
    m = await api.client.get("/metrics")
    lost = [line for line in m.text.splitlines()
            if line.startswith('greyhound_gpu_hours_lost{kind="comm_slow"}')]
    assert lost and float(lost[0].split()[-1]) > floor
    assert 'greyhound_gpu_hours_saved{kind="comm_slow"}' in m.text


async def test_acknowledge_then_close_with_notes(api: Api) -> None:
    await api.job("job-d")
    inc = await api.incident("job-d", stages=("localized",))
    op = api.auth("operator")
    heard: list[IncidentEvent] = []

    async def on_event(msg: object) -> None:
        heard.append(IncidentEvent.model_validate_json(msg.data))  # type: ignore[attr-defined]

    watcher = await api.operator()
    sub = await watcher.subscribe(Subjects.incident("job-d"), cb=on_event)
    try:
        r = await api.client.post(f"/v1/incidents/{inc}/ack", headers=op, json={"note": "mine"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["acknowledged_by"] == "operator-user" and body["status"] == "localized"
        again = await api.client.post(f"/v1/incidents/{inc}/ack", headers=op, json={})
        assert again.status_code == 409 and "operator-user" in again.json()["detail"]
        no_note = await api.client.post(f"/v1/incidents/{inc}/close", headers=op, json={})
        assert no_note.status_code == 422
        r = await api.client.post(f"/v1/incidents/{inc}/close", headers=op,
                                  json={"note": "drained node-a"})
        assert r.status_code == 200 and r.json()["status"] == "resolved"
        assert r.json()["resolved_at"] is not None
        stages = [(e["stage"], e["detail"].get("note")) for e in r.json()["timeline"]]
        assert stages[-2:] == [("acknowledged", "mine"), ("resolved", "drained node-a")]
        closed = await api.client.post(f"/v1/incidents/{inc}/close", headers=op,
                                       json={"note": "twice"})
        assert closed.status_code == 409
        for _ in range(50):
            if heard:
                break
            await asyncio.sleep(0.05)
        assert [(e.incident_id, e.stage) for e in heard] == [(inc, "resolved")]
        late = await api.client.post(f"/v1/incidents/{inc}/ack", headers=op, json={})
        assert late.status_code == 409 and "resolved" in late.json()["detail"]
    finally:
        await sub.unsubscribe()
        await watcher.close()


async def test_jobs_pages_and_state(api: Api) -> None:
    for j in ("j1", "j2", "j3"):
        await api.job(j)
    await api.incident("j2", kind="hang_hardware", before_s=0.0, after_s=90.0)
    await api.incident("j3", stages=("localized",))
    await api.incident("j1", stages=("resolved",))
    v = api.auth("viewer")
    r = await api.client.get("/v1/jobs", headers=v, params={"limit": 2})
    assert r.headers["x-total-count"] == "3" and len(r.json()) == 2
    state = {j["id"]: (j["state"], j["open_incidents"], j["ranks_known"])
             for j in (await api.client.get("/v1/jobs", headers=v)).json()}
    assert state == {"j1": ("healthy", 0, 4), "j2": ("hung", 1, 4), "j3": ("slow", 1, 4)}
    detail = (await api.client.get("/v1/jobs/j1", headers=v)).json()
    assert [r["rank"] for r in detail["ranks"]] == [0, 1, 2, 3]
    ranks = (await api.client.get("/v1/jobs/j3/ranks", headers=v)).json()
    assert {r["rank"]: r["state"] for r in ranks} == {0: "unknown", 1: "unknown",
                                                      2: "suspect", 3: "unknown"}
