"""Issue 13 for the planner: a failure between a commit and its publish loses nothing. Plan
messages, the "mitigated" incident event and re-check suspicions are staged in the commit that
makes them (services.common.outbox); a send that fails is sent again, in order (the plans stream
keeps a job's last message only, so version 2 must not overtake a version 1 left unsent), and
what a killed planner committed but never sent, the relay of the next one sends, once."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import nats.errors
import pytest

from services.common import outbox as outbox_module
from services.common.bus.contract import IncidentEvent, PlanMessage, Subjects
from services.common.bus.streams import EVENTS, PLANS
from services.common.db import repository as repo
from services.common.outbox import Outbox
from tests.services.common.support import stored
from tests.services.planner.conftest import Bench, Rig

LAYOUT = {"tp": 1, "dp": 4, "pp": 1, "gpus_per_node": 4, "microbatches": 16}


async def _stored(rig: Rig, stream: str, subject: str) -> list[bytes]:
    """Every message the stream holds on ``subject``, oldest first."""
    return await stored(await rig.js(), stream, subject)


async def _mitigated(rig: Rig, inc: str) -> list[IncidentEvent]:
    events = [IncidentEvent.model_validate_json(d)
              for d in await _stored(rig, EVENTS, Subjects.incident(rig.job))]
    return [e for e in events if e.stage == "mitigated" and e.incident_id == inc]


async def _backlog(rig: Rig) -> int:
    async with rig.ctx.db()() as session:
        return await repo.outbox_backlog(session)


async def _delivered(rig: Rig, version: int) -> bool:
    return any(d.version == version for d in await rig.deliveries())


async def _s2_applied(rig: Rig) -> str:
    """An automatic S2 plan delivered as version 1 and reported applied (incident mitigated)."""
    await rig.layout(**LAYOUT)
    inc = await rig.incident(kind="compute_slow", before_s=1.0, after_s=2.0, gpus=[1])
    await rig.wait(lambda: _has(rig, inc), "the escalation to start")
    await rig.iterations(2.0, 3)  # 3 s of loss pays for S2's 3 s overhead
    await rig.wait(lambda: _delivered(rig, 1), "version 1 delivered")
    await rig.report(1, cost_s=1.0)
    await rig.wait(lambda: _status(rig, inc, "mitigated"), "the incident mitigated")
    return inc


async def test_a_version_whose_send_fails_is_not_overtaken_and_each_goes_out_once(
        bench: Bench, monkeypatch: pytest.MonkeyPatch) -> None:
    """Version 1's sends fail while the mitigated event and version 2 (the revert) are committed
    after it and the bus takes everything else: nothing overtakes version 1 (the plans stream
    keeps the last message, so a late version 1 would undo the revert), and once it goes, all
    three go, in commit order, once each."""
    real_send = outbox_module.send
    down = True
    failed: Counter[str] = Counter()
    order: list[str] = []

    async def flaky_send(js: Any, subject: str, payload: bytes, event_id: str) -> bool:
        if down and subject.endswith(".plan") and json.loads(payload)["version"] == 1:
            failed[event_id] += 1
            raise nats.errors.TimeoutError  # the bus did not answer: transient
        dup = await real_send(js, subject, payload, event_id)
        assert not dup, f"{event_id} sent twice"
        order.append(event_id)
        return dup

    monkeypatch.setattr(outbox_module, "send", flaky_send)
    async with bench.planner() as rig:
        inc = await _s2_applied(rig)
        await rig.iterations(1.1, 30)  # under the plan, long after it
        await rig.wait(lambda: _fed(rig, inc, rig.iteration), "the iterations under the plan")
        await rig.recovery(before_s=1.1, after_s=1.0)  # not the pre-plan level: the fault ended
        await rig.resolve(inc)
        await rig.wait(lambda: _delivered(rig, 2), "version 2 (the revert) committed")
        await asyncio.sleep(0.5)  # several flushes and ticks: an overtaking send would be done
        assert await _stored(rig, PLANS, Subjects.plan(rig.job)) == []
        assert await _mitigated(rig, inc) == []
        assert await _backlog(rig) == 3 and order == []
        down = False
        await rig.wait(lambda: _backlog_is(rig, 0), "the backlog sent")
        plans = [PlanMessage.model_validate_json(d)
                 for d in await _stored(rig, PLANS, Subjects.plan(rig.job))]
        assert [(p.version, p.action) for p in plans] == [(2, "revert")]  # the last one kept
        (mitigated,) = await _mitigated(rig, inc)
        v1, v2 = (d.message.event_id for d in await rig.deliveries())
    assert order == [v1, mitigated.event_id, v2], order
    assert set(failed) == {v1} and failed[v1] >= 2, failed  # retried, by flushes and ticks


async def test_what_a_killed_planner_committed_the_next_ones_relay_sends_once(
        bench: Bench, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed after each commit and before its send (no flush ever runs, its relay waits an
    hour), the planner leaves version 1 and the mitigated event in the outbox; the relay of the
    planner that replaces it sends both, once."""

    async def killed(self: Outbox, *_: object) -> int:
        return 0

    monkeypatch.setattr(Outbox, "flush", killed)  # what a unit of work sends once committed
    monkeypatch.setattr(Outbox, "send_pending", killed)  # what each round sends
    async with bench.planner(service={"outbox_grace_s": 3600.0}) as rig:
        inc = await _s2_applied(rig)
        await asyncio.sleep(0.5)  # a send would have happened by now
        assert await _stored(rig, PLANS, Subjects.plan(rig.job)) == []
        assert await _mitigated(rig, inc) == []
        assert await _backlog(rig) == 2
        job = rig.job
    async with bench.planner(service={"outbox_grace_s": 0.0, "outbox_poll_s": 0.2}) as again:
        again.job = job
        await again.wait(lambda: _backlog_is(again, 0), "the relay to send the backlog", 60.0)
        await asyncio.sleep(0.5)  # a second send would be stored by now
        (plan,) = [PlanMessage.model_validate_json(d)
                   for d in await _stored(again, PLANS, Subjects.plan(job))]
        assert (plan.version, plan.action, plan.strategy) == (1, "apply", "S2")
        (mitigated,) = await _mitigated(again, inc)
        assert mitigated.job_id == job


async def _has(rig: Rig, inc: str) -> bool:
    return inc in rig.planner.tracked


async def _status(rig: Rig, inc: str, status: str) -> bool:
    return (await rig.incident_row(inc)).status == status


async def _fed(rig: Rig, inc: str, n: int) -> bool:
    t = rig.planner.tracked.get(inc)
    return t is not None and t.fed >= n


async def _backlog_is(rig: Rig, n: int) -> bool:
    return await _backlog(rig) == n
