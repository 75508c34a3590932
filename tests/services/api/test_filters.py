"""A filter value the server does not know is a 422 that lists the valid ones, never an empty
200 that reads as "nothing matched"."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

import pytest

from greyhound.core.incident_kinds import KINDS
from greyhound.core.plan_lifecycle import PLAN_STATUSES
from services.api.schemas import AuditTarget
from services.common.webhooks.payload import EVENTS
from tests.services.api.conftest import Api

REPO = Path(__file__).resolve().parents[3]


def _problem(r: object, field: str, valid: tuple[str, ...]) -> str:
    assert r.status_code == 422, r.text  # type: ignore[attr-defined]
    body = r.json()  # type: ignore[attr-defined]
    assert r.headers["content-type"] == "application/problem+json"  # type: ignore[attr-defined]
    assert field in body["detail"], body
    missing = [v for v in valid if v not in body["detail"]]
    assert not missing, f"the 422 does not list {missing}: {body['detail']}"
    return str(body["detail"])


@pytest.mark.parametrize(("path", "params", "field", "valid"), [
    ("/v1/plans", {"status": "bogus"}, "status", PLAN_STATUSES),
    ("/v1/incidents", {"status": "bogus"}, "status", ("open", "detected", "resolved")),
    ("/v1/incidents", {"kind": "bogus"}, "kind", KINDS),
    ("/v1/incidents", {"kind": "bogus*"}, "kind", KINDS),
    ("/v1/fleet", {"kind": "disk"}, "kind", ("gpu", "node", "link")),
    ("/v1/fleet", {"advice": "panic"}, "advice", ("drain", "watch", "ok")),
    ("/v1/audit", {"target_type": "bogus"}, "target_type", get_args(AuditTarget)),
])
async def test_an_unknown_filter_value_is_a_422_listing_the_valid_ones(
        api: Api, path: str, params: dict[str, str], field: str, valid: tuple[str, ...]) -> None:
    r = await api.client.get(path, headers=api.auth("admin"), params=params)
    _problem(r, field, valid)


async def test_known_values_and_prefixes_still_filter(api: Api) -> None:
    await api.job("job-k")
    hang = await api.incident("job-k", kind="hang_hardware", before_s=0.0, after_s=90.0)
    v = api.auth("viewer")
    for kind in ("hang*", "hang_hardware"):
        r = await api.client.get("/v1/incidents", headers=v, params={"kind": kind})
        assert r.status_code == 200 and [i["id"] for i in r.json()] == [hang]
    r = await api.client.get("/v1/incidents", headers=v, params={"kind": "comm_slow"})
    assert r.status_code == 200 and r.json() == []  # a real kind with no incident yet
    r = await api.client.get("/v1/plans", headers=v, params={"status": "proposed"})
    assert r.status_code == 200 and r.json() == []


async def test_an_unknown_event_name_in_a_webhook_is_a_422_listing_the_events(api: Api) -> None:
    r = await api.client.post("/v1/webhooks", headers=api.auth("admin"), json={
        "url": "http://127.0.0.1:9/hook", "events": ["incident.opend"]})
    _problem(r, "events", tuple(e for e in EVENTS))


def test_every_audited_target_is_a_filter_value() -> None:
    """The audit filter's values are the target types the code writes: a new one must be
    added to AuditTarget, or filtering on it would be refused."""
    written: set[str] = set()
    for path in [*(REPO / "services").rglob("*.py"), *(REPO / "stack").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg == "target_type" and isinstance(kw.value, ast.Constant):
                        written.add(str(kw.value.value))
    assert written and written <= set(get_args(AuditTarget)), written
