"""One validation per job across validators (issue 21): two validators with a suspicion each of
one job never hold it at once (the second waits, then pauses once the first resumed it), and a
validator that died holding a job frees it when its lease lapses, not before."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence

import pytest

from services.common.bus.contract import Suspicion
from services.common.db import exclusion
from services.common.db import repository as repo
from services.common.db.models import Rank
from services.common.runtime import ServiceContext
from services.validator.hold import Run
from services.validator.service import Validator
from services.validator.settings import ValidatorSettings
from tests.conftest import Bus
from tests.services.validator.incidents import localized

# leases short enough to lapse within a test: a job is held 0.3 + 0.3 + 0.6 = 1.2 s unrenewed
SHORT = ValidatorSettings(claim_lease_s=0.6, pause_budget_s=0.3, status_timeout_s=0.3)


@pytest.fixture()
async def two(bus: Bus, fresh_db_url: str) -> AsyncIterator[tuple[ServiceContext, ServiceContext]]:
    async with bus.service("validator", fresh_db_url) as a, \
            bus.service("validator", fresh_db_url) as b:
        yield a, b


class Spans:
    """A stand-in for the hold on the job: records when each validation held it, and holds it
    until told to let go."""

    def __init__(self) -> None:
        self.held: list[tuple[str, float, float]] = []  # (validator, start, end)
        self.entered: dict[str, asyncio.Event] = {}
        self.let_go: dict[str, asyncio.Event] = {}

    def install(self, v: Validator, name: str) -> None:
        self.entered[name], self.let_go[name] = asyncio.Event(), asyncio.Event()

        async def hold(s: Suspicion, ranks: Sequence[Rank]) -> Run:
            start = time.monotonic()
            self.entered[name].set()
            await self.let_go[name].wait()
            self.held.append((name, start, time.monotonic()))
            return Run(failure="test hold")

        v.hold.validate = hold


async def test_a_second_validator_waits_for_the_job_the_first_holds(
        two: tuple[ServiceContext, ServiceContext]) -> None:
    a, b = two
    job = f"one-{uuid.uuid4().hex[:6]}"
    s1, s2 = await localized(a, job, "slowdown"), await localized(a, job, "slowdown-2")
    va, vb = Validator(a, ValidatorSettings()), Validator(b, ValidatorSettings())
    spans = Spans()
    spans.install(va, "a")
    spans.install(vb, "b")
    first = asyncio.create_task(va.validate_once(s1))
    await asyncio.wait_for(spans.entered["a"].wait(), 30)
    second = asyncio.create_task(vb.validate_once(s2))
    await asyncio.sleep(2.0)  # four of its polls: it must still be waiting
    assert not spans.entered["b"].is_set()
    async with a.db()() as session:
        holder = await exclusion.job_validation(session, job)
    assert holder is not None and (holder.holder, holder.suspicion_id) == (va.holder, s1.event_id)
    assert not await vb.claims.take_job(s2)
    spans.let_go["a"].set()
    await asyncio.wait_for(first, 30)
    await asyncio.wait_for(spans.entered["b"].wait(), 30)
    spans.let_go["b"].set()
    await asyncio.wait_for(second, 30)
    (_, _, a_end), (_, b_start, _) = sorted(spans.held)
    assert a_end <= b_start  # never held at once: a's resume came before b's pause
    async with a.db()() as session:
        assert await exclusion.job_validation(session, job) is None  # given back
        for s in (s1, s2):  # both validated (here: recorded as not carried out), once
            inc = await repo.get_incident(session, s.incident_id)
            assert inc is not None and inc.evidence.validation is not None
            assert inc.evidence.validation.outcome == "test hold"


async def test_a_dead_validators_job_is_free_once_its_lease_lapsed(
        two: tuple[ServiceContext, ServiceContext]) -> None:
    """Validator A takes the job and dies (it never renews nor gives it back): B cannot take it
    while A's lease runs (its suspicion claim's: B takes the job when it may take the
    suspicion over), and takes it after."""
    a, b = two
    job = f"dead-{uuid.uuid4().hex[:6]}"
    s1, s2 = await localized(a, job, "slowdown"), await localized(a, job, "slowdown-2")
    va, vb = Validator(a, SHORT), Validator(b, SHORT)
    assert va.claims.job_lease_s == SHORT.claim_lease_s
    taken = time.monotonic()
    assert await va.claims.take_job(s1)
    assert not await vb.claims.take_job(s2)
    spans = Spans()
    spans.install(vb, "b")
    spans.let_go["b"].set()
    await asyncio.wait_for(vb.validate_once(s2), 30)
    ((_, b_start, _),) = spans.held
    assert b_start - taken >= va.claims.job_lease_s * 0.9  # not before A's lease ran out
    async with a.db()() as session:
        assert await exclusion.job_validation(session, job) is None
    # A, were it alive after all, no longer holds the job: its release changes nothing
    async with a.db()() as session:
        assert not await exclusion.release_job_validation(
            session, job_id=job, holder=va.holder, suspicion_id=s1.event_id)
