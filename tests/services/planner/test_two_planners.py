"""Two planners on one database (issue 21): the same proposal from both is one plan, delivered
once (a unique index, not a convention; the loser treats it as already proposed); versions of a
job rise across planners, whatever retention deleted; and no relay leaves the plans stream on
an older version than one already sent."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import nats.js.errors
import pytest
from nats.js import JetStreamContext
from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError

from greyhound.core.escalation import Apply, Strategy
from greyhound.core.tracked_incident import Tracked
from services.common import outbox as outbox_module
from services.common.bus.contract import JobLayout, PlanMessage, Subjects
from services.common.bus.streams import PLANS
from services.common.db import repository as repo
from services.common.db.documents import (
    Culprit,
    Detection,
    Empty,
    Evidence,
    Gpu,
    MicrobatchParams,
    Validation,
)
from services.common.db.models import OutboxMessage, Plan, PlanDelivery
from services.common.outbox import Outbox
from services.common.runtime import ServiceContext
from services.planner import escalations
from services.planner.delivery import deliver
from services.planner.settings import PlannerSettings
from services.planner.state import PlannerState
from tests.conftest import Bus
from tests.services.planner.conftest import FAST

LAYOUT = JobLayout(tp=1, dp=4, pp=1, gpus_per_node=4, microbatches=16)
S2 = MicrobatchParams(kind="microbatch", microbatches=[5, 3, 4, 4], previous=[4, 4, 4, 4],
                      times=[1.0, 2.0, 1.0, 1.0], multiple_of=1, slow_dp_groups=[1],
                      makespan_before=8.0, makespan_after=6.0)


async def _nothing(*_: Any) -> None:
    return None


@pytest.fixture()
async def two(bus: Bus, fresh_db_url: str) -> AsyncIterator[tuple[PlannerState, PlannerState]]:
    """Two planners' states (their connections, units of work and outboxes), not running:
    the tests call what their handlers and rounds call."""
    async with bus.service("planner", fresh_db_url) as a, \
            bus.service("planner", fresh_db_url) as b:
        states = (PlannerState.of(a, PlannerSettings(**FAST), _nothing),
                  PlannerState.of(b, PlannerSettings(**FAST), _nothing))
        try:
            yield states
        finally:
            for st in states:
                await st.watches.close()


async def _validated(ctx: ServiceContext, job: str) -> str:
    """A job with a layout and a validated compute slowdown on GPU 1."""
    detection = Detection(event_id=uuid.uuid4().hex, ranks=[0, 1], method="bocd-v",
                          before_s=1.0, after_s=2.0, healthy_s=1.0, first_iteration=10,
                          detected_iteration=12, change="onset")
    validation = Validation(suspicion=uuid.uuid4().hex, verdict="compute_slow",
                            gemm_s={"1": 2.0})
    async with ctx.db()() as session:
        await repo.set_job_layout(session, job, LAYOUT)
        inc = await repo.open_incident(
            session, job_id=job, kind="compute_slow", dedup_key="slowdown", severity=2.0,
            summary="test", culprit=Culprit(gpus=[Gpu(rank=1, node=0, host="h", device=1)],
                                            ranks=[1]),
            evidence=Evidence(detection=detection, validation=validation),
            stage_detail=detection)
        await repo.add_timeline(session, inc, "localized", Empty())
        await repo.add_timeline(session, inc, "validated", validation)
        await session.commit()
    return inc.id


async def _tracked(st: PlannerState, incident_id: str) -> Tracked:
    async with st.work.unit() as uow:
        inc = await repo.get_incident_for_update(uow.session, incident_id)
        assert inc is not None
        t = await escalations.start(st, uow.session, inc, inc.evidence.validation)
    assert t is not None
    return t


async def _rows(ctx: ServiceContext, job: str) -> tuple[list[Plan], list[PlanDelivery],
                                                        list[OutboxMessage]]:
    async with ctx.db()() as session:
        plans = (await session.scalars(select(Plan).where(Plan.job_id == job))).all()
        sent = (await session.scalars(select(PlanDelivery).where(PlanDelivery.job_id == job)
                                      .order_by(PlanDelivery.version))).all()
        out = (await session.scalars(select(OutboxMessage).where(
            OutboxMessage.subject == Subjects.plan(job)).order_by(OutboxMessage.seq))).all()
    return list(plans), list(sent), list(out)


@pytest.fixture()
async def looker(bus: Bus) -> AsyncIterator[JetStreamContext]:
    """The operator, to read the plans stream (no service may)."""
    nc = await bus.connect()
    yield nc.jetstream()
    await nc.close()


async def _stream_version(js: JetStreamContext, job: str) -> int | None:
    """The version the plans stream holds for the job (None: nothing)."""
    try:
        raw = await js.get_last_msg(PLANS, Subjects.plan(job))
    except nats.js.errors.NotFoundError:
        return None
    assert raw.data is not None
    return PlanMessage.model_validate_json(raw.data).version


def _s2(t: Tracked) -> Apply:
    """Three iterations 1 s over the healthy 1 s: S2's 3 s overhead is paid."""
    decisions = [t.esc.observe(2.0) for _ in range(3)]
    assert isinstance(decisions[-1], Apply) and decisions[-1].strategy is Strategy.MICROBATCH
    return decisions[-1]


@pytest.mark.parametrize("policy", ["automatic", "approval"])
async def test_both_planners_proposing_one_strategy_make_one_plan_delivered_once(
        two: tuple[PlannerState, PlannerState], policy: str) -> None:
    """Both planners' escalations of one incident reach S2 at once: one plan, delivered (when
    automatic) once; the second proposal is "already proposed", not an error, and its
    escalation waits on the first's plan."""
    a, b = two
    for st in two:
        st.config = st.config.model_copy(update={"s2_policy": policy})
    job = f"two-{uuid.uuid4().hex[:6]}"
    inc = await _validated(a.ctx, job)
    ta, tb = await _tracked(a, inc), await _tracked(b, inc)
    await asyncio.gather(escalations.propose(a, ta, _s2(ta)), escalations.propose(b, tb, _s2(tb)))
    plans, sent, out = await _rows(a.ctx, job)
    assert [p.strategy for p in plans] == ["S2"]
    assert plans[0].status == ("approved" if policy == "automatic" else "proposed")
    assert [(s.version, s.plan_id) for s in sent] == ([(1, plans[0].id)] * (policy == "automatic"))
    assert len(out) == len(sent)
    assert ta.pending_plan == tb.pending_plan == plans[0].id
    assert ta.esc.pending is tb.esc.pending is Strategy.MICROBATCH


async def test_the_index_admits_one_open_plan_per_incident_and_strategy(
        two: tuple[PlannerState, PlannerState]) -> None:
    """The rule is the database's: a second open plan written past the repository is refused;
    once the first is final, a new one of that strategy may open."""
    a, _ = two
    job = f"idx-{uuid.uuid4().hex[:6]}"
    inc = await _validated(a.ctx, job)
    params = S2
    made: dict[str, Any] = {"incident_id": inc, "job_id": job, "strategy": "S2",
                            "params": params, "policy": "approval", "expected_gain": None,
                            "expires_at": None}
    async with a.ctx.db()() as session:
        first = await repo.create_plan(session, **made)
        assert first is not None
        assert await repo.create_plan(session, **made) is None  # already proposed
        assert await repo.create_plan(session, **{**made, "strategy": "S3"}) is not None
        await session.commit()
    async with a.ctx.db()() as session:
        session.add(Plan(incident_id=inc, job_id=job, strategy="S2", params=params))
        with pytest.raises(IntegrityError, match="uq_plans_open_strategy"):
            await session.flush()
    async with a.ctx.db()() as session:
        plan = await repo.get_plan(session, first.id, for_update=True)
        assert plan is not None
        repo.move_plan(plan, "reject")
        assert await repo.create_plan(session, **made) is not None
        await session.commit()


async def test_versions_rise_across_two_racing_planners_and_survive_retention(
        two: tuple[PlannerState, PlannerState], looker: JetStreamContext) -> None:
    """Twenty deliveries of one job, half by each planner, all at once: versions 1..20, each
    once, committed (and staged) in version order, the stream left on 20; after retention
    deleted every delivery the next is 21, not 1."""
    a, b = two
    job = f"ver-{uuid.uuid4().hex[:6]}"
    inc = await _validated(a.ctx, job)
    async with a.ctx.db()() as session:
        plan = await repo.create_plan(
            session, incident_id=inc, job_id=job, strategy="S2",
            params=S2, policy="automatic",
            expected_gain=None, expires_at=None)
        assert plan is not None
        await session.commit()
    async with a.ctx.db()() as session:
        layout = await a.layout(session, job)
    assert layout is not None

    async def one(st: PlannerState) -> None:
        async with st.work.unit() as uow:
            row = await repo.get_plan(uow.session, plan.id)
            assert row is not None
            await uow.stage(Subjects.plan(job), await deliver(uow.session, row, layout, None))

    await asyncio.gather(*(one(st) for _ in range(10) for st in (a, b)))
    for st in (a, b):
        await st.work.send_pending()
    _, sent, out = await _rows(a.ctx, job)
    assert [s.version for s in sent] == list(range(1, 21))
    assert [json.loads(m.payload)["version"] for m in out] == list(range(1, 21))
    assert all(m.sent_at is not None for m in out)
    assert await _stream_version(looker, job) == 20
    async with a.ctx.db()() as session:
        await session.execute(delete(PlanDelivery).where(PlanDelivery.job_id == job))
        await session.commit()
    await one(b)
    _, sent, _ = await _rows(a.ctx, job)
    assert [s.version for s in sent] == [21]


def _plan(job: str, version: int) -> PlanMessage:
    return PlanMessage(job_id=job, version=version, plan_id="p", incident_id="i",
                       strategy="S2", action="apply")


async def _stage(st: PlannerState, relay: Outbox, *msgs: PlanMessage) -> list[str]:
    """Committed and left unsent (as by a planner that died before its flush)."""
    async with st.ctx.db()() as session:
        ids = [await relay.stage(session, Subjects.plan(m.job_id), m) for m in msgs]
        await session.commit()
    return ids


def _outbox(st: PlannerState) -> Outbox:
    return Outbox(st.ctx.db(), st.ctx.js, producer="planner", ordered=True,
                  latest_only=frozenset({PlanMessage.__name__}))


async def test_a_relay_never_sends_a_version_after_a_later_one(
        two: tuple[PlannerState, PlannerState], looker: JetStreamContext,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Planner A's relay is in the middle of sending version 1 (the bus slow to answer) when
    planner B's relay finds version 2: B waits for A rather than send 2 before A's 1 lands
    (which would leave the stream on 1); then 2 goes. And a version 3 left unsent by a planner
    that died is not sent after 4 went: it is superseded."""
    a, b = two
    relay_a, relay_b = _outbox(a), _outbox(b)
    job = f"rel-{uuid.uuid4().hex[:6]}"
    real_send = outbox_module.send
    held, release = asyncio.Event(), asyncio.Event()

    async def slow_v1(js: Any, subject: str, payload: bytes, event_id: str) -> bool:
        if json.loads(payload)["version"] == 1:
            held.set()
            await release.wait()
        return await real_send(js, subject, payload, event_id)

    monkeypatch.setattr(outbox_module, "send", slow_v1)
    await _stage(a, relay_a, _plan(job, 1))
    sending = asyncio.create_task(relay_a.send_pending())  # rows: [v1], held in its send
    await asyncio.wait_for(held.wait(), 30)
    await _stage(b, relay_b, _plan(job, 2))
    assert await relay_b.send_pending() == 0  # v1 is A's (locked): B must not send v2 now
    assert await _stream_version(looker, job) is None
    release.set()
    assert await sending == 1
    assert await relay_b.send_pending() == 1
    assert await _stream_version(looker, job) == 2

    v3, v4 = await _stage(a, relay_a, _plan(job, 3), _plan(job, 4))
    plain = Outbox(b.ctx.db(), b.ctx.js, producer="planner")  # sends only the ids it is given
    assert await plain.flush([v4]) == 1
    assert await relay_a.send_pending() == 1  # v3, marked sent, not published
    assert relay_a.stats.superseded == 1
    assert await _stream_version(looker, job) == 4
    async with a.ctx.db()() as session:
        assert await repo.outbox_backlog(session) == 0
        assert v3 in {m.event_id for m in (await session.scalars(select(OutboxMessage))).all()}
