"""One validation per suspicion: a live claim or a finished one is never validated again (no
second pause), a claim whose validator died is taken over with the next attempt number, and
one out of attempts is recorded as abandoned without touching the job."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from nats.aio.msg import Msg

from services.common.bus.client import BusClient
from services.common.bus.contract import AgentHello, RankInfo, Subjects, Suspicion
from services.common.db import repository as repo
from services.common.db.models import ValidationClaim
from services.common.runtime import ServiceContext
from services.tracker.service import Tracker
from services.tracker.settings import TrackerSettings
from services.validator.service import Validator
from services.validator.settings import ValidatorSettings
from tests.conftest import Bus
from tests.services.validator.incidents import localized


@pytest.fixture()
async def ctx(bus: Bus, fresh_db_url: str) -> AsyncIterator[ServiceContext]:
    async with bus.service("validator", fresh_db_url) as c:
        yield c


@pytest.fixture()
async def operator(bus: Bus) -> AsyncIterator[BusClient]:
    """Watches the control subjects: only the operator may hear every agent's."""
    nc = await bus.connect()
    yield nc
    await nc.close()


async def claim_row(ctx: ServiceContext, s: Suspicion, *, state: str, attempts: int,
                    lease_s: float) -> None:
    async with ctx.db()() as session:
        session.add(ValidationClaim(
            suspicion_id=s.event_id, incident_id=s.incident_id, job_id=s.job_id,
            suspicion=s.model_dump_json(), state=state, attempts=attempts, holder="dead-one",
            lease_until=datetime.now(UTC) + timedelta(seconds=lease_s)))
        await session.commit()


async def claim_of(ctx: ServiceContext, s: Suspicion) -> ValidationClaim:
    async with ctx.db()() as session:
        got = await session.get(ValidationClaim, s.event_id)
        assert got is not None
        return got


async def control_requests(operator: BusClient, job: str) -> list[Any]:
    """Every control request sent for the job (nobody answers: the validator sees no agents)."""
    seen: list[Any] = []

    async def note(msg: Msg) -> None:
        seen.append(msg.subject)

    await operator.subscribe(f"{Subjects.control(job, 'x').rsplit('.', 1)[0]}.*", cb=note)
    await operator.flush()
    return seen


@pytest.mark.parametrize("state", ["done", "abandoned", "running"])
async def test_a_live_or_finished_claim_is_not_validated_again(ctx: ServiceContext,
                                                               operator: BusClient,
                                                               state: str) -> None:
    job = f"claimed-{uuid.uuid4().hex[:6]}"
    s = await localized(ctx, job)
    await claim_row(ctx, s, state=state, attempts=1, lease_s=60.0)
    seen = await control_requests(operator, job)
    v = Validator(ctx, ValidatorSettings())
    await v.consume(Subjects.suspicion(job), s)  # a redelivery
    assert await v.resume_once() == 0  # nothing lapsed, nothing lost
    assert not v.runs and not seen
    claim = await claim_of(ctx, s)
    assert (claim.state, claim.attempts, claim.holder) == (state, 1, "dead-one")


async def test_a_dead_validators_claim_is_taken_over_once(ctx: ServiceContext) -> None:
    job = f"lapsed-{uuid.uuid4().hex[:6]}"
    s = await localized(ctx, job)
    await claim_row(ctx, s, state="running", attempts=1, lease_s=-1.0)  # its lease ran out
    v = Validator(ctx, ValidatorSettings(max_attempts=2))
    assert await v.resume_once() == 1
    claim = await claim_of(ctx, s)
    assert (claim.state, claim.attempts, claim.holder) == ("done", 2, v.holder)
    assert v.runs[-1].evidence["attempt"] == 2  # the job has no agents: recorded as not done
    async with ctx.db()() as session:
        inc = await repo.get_incident(session, s.incident_id)
    assert inc is not None and inc.evidence.validation is not None
    assert inc.evidence.validation.outcome == "no ranks known for the job"
    assert await v.resume_once() == 0


async def test_out_of_attempts_is_recorded_as_abandoned_without_a_pause(
        ctx: ServiceContext, operator: BusClient) -> None:
    job = f"spent-{uuid.uuid4().hex[:6]}"
    s = await localized(ctx, job)
    await claim_row(ctx, s, state="running", attempts=2, lease_s=-1.0)
    seen = await control_requests(operator, job)
    v = Validator(ctx, ValidatorSettings(max_attempts=2))
    await v.resume_once()
    claim = await claim_of(ctx, s)
    assert claim.state == "abandoned" and not v.runs and not seen
    async with ctx.db()() as session:
        inc = await repo.get_incident(session, s.incident_id)
    assert inc is not None and inc.status == "localized"
    assert inc.evidence.validation is not None
    assert (inc.evidence.validation.outcome or "").startswith("abandoned: 2 attempt(s)")


async def test_ranks_without_completion_marks_are_named_in_the_validation(
        ctx: ServiceContext) -> None:
    """The agent's hello says rank 1 has no GPU completion marks (its hook found no CUDA API):
    a validation, which times the suspects on their GPUs, says which ranks it could not (here
    it cannot even ask the agent, which does not answer: the record says both)."""
    job = f"blind-{uuid.uuid4().hex[:6]}"
    s = await localized(ctx, job)
    await Tracker(ctx, settings=TrackerSettings()).handle(Subjects.hello(job, "a1"), AgentHello(
        job_id=job, agent_id="a1", host="h1", marks_off=[1],
        ranks=[RankInfo(rank=r, host="h1", pid=100 + r, device=r) for r in (0, 1)]))
    v = Validator(ctx, ValidatorSettings(status_timeout_s=0.5))
    await v.consume(Subjects.suspicion(job), s)
    async with ctx.db()() as session:
        inc = await repo.get_incident(session, s.incident_id)
    assert inc is not None and inc.evidence.validation is not None
    assert inc.evidence.validation.marks_off_ranks == [1]
    assert (inc.evidence.validation.outcome or "").startswith("abandoned"), inc.evidence
