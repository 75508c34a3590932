"""A read route answers from one snapshot of the database: a commit that lands between the
statements of one answer (the incidents, then their timelines) is in all of the answer or in
none of it. CI once got an incident whose timeline said "localized" beside the kind and status
from before its localisation."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import event, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.util import await_only

from services.api.deps import SNAPSHOT
from services.common.db import repository as repo
from services.common.db.documents import OperatorNote
from tests.services.api.conftest import Api


@pytest.mark.parametrize("detail", [False, True], ids=["list", "detail"])
async def test_a_localisation_committed_mid_read_is_in_none_of_the_answer(api: Api,
                                                                          detail: bool) -> None:
    await api.job("job-s")
    incident_id = await api.incident("job-s")
    sessions, engine = api.ctx.db(), api.ctx.engine
    assert engine is not None
    landed: list[str] = []

    async def localise() -> None:
        """What the analyzer commits: the kind and the timeline's entry in one transaction."""
        async with sessions() as session:
            inc = await repo.get_incident_for_update(session, incident_id)
            assert inc is not None
            inc.kind = "comm_slow"
            await repo.add_timeline(session, inc, "localized", OperatorNote(by="test", note=""))
            await session.commit()

    def between(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        # The answer's second statement (its timelines) is about to run: the analyzer commits
        # first. This runs in the API's greenlet, which may wait for a coroutine.
        if not landed and "FROM incident_events" in statement:
            landed.append(statement)
            await_only(localise())

    url = f"/v1/incidents/{incident_id}" if detail else "/v1/incidents"
    params = {} if detail else {"job_id": "job-s"}
    event.listen(engine.sync_engine, "before_cursor_execute", between)
    try:
        r = await api.client.get(url, headers=api.auth("viewer"), params=params)
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", between)
    assert r.status_code == 200, r.text
    assert landed, "the timeline's statement never ran"
    row = r.json() if detail else r.json()[0]
    stages = [e["stage"] for e in row["timeline"]]
    # the snapshot of the answer's first statement: before the localisation, all of it
    assert (row["kind"], row["status"], stages) == ("slowdown", "detected", ["detected"]), row
    r = await api.client.get(url, headers=api.auth("viewer"), params=params)
    row = r.json() if detail else r.json()[0]
    stages = [e["stage"] for e in row["timeline"]]
    assert (row["kind"], row["status"], stages) == ("comm_slow", "localized",
                                                    ["detected", "localized"]), row


async def test_a_read_route_cannot_write(api: Api) -> None:
    """A read's unit is read-only: a route that wrote would fail loudly, in every test that
    calls it, rather than fail now and then on a serialization conflict under load."""
    await api.job("job-w")
    async with api.ctx.db()() as session:
        await session.connection(execution_options=SNAPSHOT)
        with pytest.raises(DBAPIError, match="read-only transaction"):
            await session.execute(text("UPDATE jobs SET last_seen_at = now()"))
    r = await api.client.get("/v1/jobs/job-w", headers=api.auth("viewer"))
    assert r.status_code == 200 and r.json()["id"] == "job-w", r.text
