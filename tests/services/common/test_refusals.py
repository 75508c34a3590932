"""At run time a permission refusal is a permanent error, never a timeout retried as transient,
and no message blocks the ones behind it for ever.

* a request the server refuses raises PermissionDenied, naming the user and the subject;
* a handler whose request is refused has its message dead-lettered at once, not retried;
* a consumer refused its fetch or its acks ends (ConsumerLost, naming the grant) instead of
  looking idle or healthy for ever;
* one job's message that keeps failing, slowly, holds up only that job's later messages: the
  other jobs are handled at once, and the failing job's reach the dead-letter queue after their
  bounded deliveries.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

import pytest

from services.common.bus.auth import agent_user
from services.common.bus.client import (
    Consumer,
    ConsumerLost,
    TransientError,
    ensure_streams,
    publish,
)
from services.common.bus.contract import CollectiveBatch, IterationBatch, Subjects, Suspicion
from services.common.bus.errors import classify
from services.common.bus.refusals import PermissionDenied
from services.common.bus.streams import ANALYZER_COLLECTIVES, TELEMETRY, TRACKER, ConsumerSpec
from services.common.settings import Settings
from tests.conftest import Bus, new_bus
from tests.services.common.support import batch, jetstream, letters_for, until


async def test_a_refused_request_is_a_permanent_error(bus: Bus) -> None:
    agent = await bus.connect(agent_user("rf-a"))
    try:
        t0 = time.monotonic()
        with pytest.raises(PermissionDenied) as err:
            await agent.jetstream().stream_info(TELEMETRY)  # agents only publish
        assert time.monotonic() - t0 < 10
    finally:
        await agent.close()
    assert classify(err.value) == "permanent"
    assert "bus user 'agent-rf-a'" in str(err.value)
    assert "$js.api.stream.info.gh_telemetry" in str(err.value)


def _tracker_spec(job: str, **kw: object) -> ConsumerSpec:
    """The tracker's own durable (the only one its user may bind), narrowed to one job."""
    return dataclasses.replace(TRACKER, filter_subjects=(Subjects.iterations(job, "rf"),), **kw)


async def test_a_refused_call_in_a_handler_is_dead_lettered_not_retried() -> None:
    with new_bus("gh-rf-") as bus:
        job = f"rf{uuid.uuid4().hex[:6]}"
        tracker = await bus.connect("tracker")
        agent = await bus.connect(agent_user("rf"))
        operator, _ = await jetstream(bus, "rf-op")
        calls: list[int] = []

        async def handler(_subject: str, msg: IterationBatch) -> None:
            calls.append(msg.iteration[0])
            # a suspicion is the analyzer's to send, not the tracker's
            await publish(tracker.jetstream(), Subjects.suspicion(job), Suspicion(
                job_id=job, incident_id="i", kind="compute_slow", ranks=[1], comm_ids=[]))

        consumer: Consumer[IterationBatch] = Consumer(tracker.jetstream(), _tracker_spec(job),
                                                      IterationBatch, handler)
        runner = asyncio.create_task(consumer.run())
        try:
            await publish(agent.jetstream(), Subjects.iterations(job, "rf"), batch(job, 4, agent="rf"))
            await until(lambda: consumer.stats.dead_lettered == 1, what="the dead letter")
            await asyncio.sleep(1.5)  # a retry would come by now
            assert calls == [4] and consumer.stats.retried == 0
        finally:
            consumer.stop()
            await asyncio.wait_for(runner, 30)
        (letter,) = await letters_for(operator.jetstream(), TELEMETRY,
                                      Subjects.iterations(job, "rf"))
        assert letter.reason.startswith("handler_error: PermissionDenied"), letter.reason
        assert "suspect" in letter.reason
        for nc in (tracker, agent, operator):
            await nc.close()


@pytest.mark.parametrize("grant", ["fetch", "ack"])
async def test_a_consumer_refused_its_fetch_or_ack_ends_naming_it(grant: str) -> None:
    """The analyzer's collectives durable, on a server that lacks one of its grants."""
    with new_bus("gh-rf-") as bus:
        job = f"rf{uuid.uuid4().hex[:6]}"
        durable = ANALYZER_COLLECTIVES.durable
        subject = {"fetch": f"$JS.API.CONSUMER.MSG.NEXT.{TELEMETRY}.{durable}",
                   "ack": f"$JS.ACK.{TELEMETRY}.{durable}.>"}[grant]
        agent = await bus.connect(agent_user("rf"))  # first: a new user rewrites the config
        bus.withdraw("analyzer", subject)
        analyzer = await bus.connect("analyzer")
        await ensure_streams(analyzer.jetstream(), Settings())
        handled: list[str] = []

        async def handler(_subject: str, msg: CollectiveBatch) -> None:
            handled.append(msg.job_id)

        spec = dataclasses.replace(ANALYZER_COLLECTIVES,
                                   filter_subjects=(Subjects.collectives(job, "rf"),))
        consumer: Consumer[CollectiveBatch] = Consumer(analyzer.jetstream(), spec,
                                                       CollectiveBatch, handler)
        runner = asyncio.create_task(consumer.run())
        try:
            await publish(agent.jetstream(), Subjects.collectives(job, "rf"), CollectiveBatch(
                job_id=job, agent_id="rf", **{c: [1] for c in CollectiveBatch.COLUMNS}))
            with pytest.raises(ConsumerLost) as err:
                await asyncio.wait_for(runner, 30)
        finally:
            consumer.stop()
            for nc in (analyzer, agent):
                await nc.close()
        assert "bus user 'analyzer'" in str(err.value)
        assert subject.lower().rstrip(">") in str(err.value), str(err.value)
        assert handled == ([job] if grant == "ack" else [])


async def test_one_jobs_failing_message_holds_up_only_that_job(bus: Bus) -> None:
    """Job A's handler fails after a second every time (a dependency timing out); job B's
    messages, published behind A's, are handled at once. Without the hold each of A's twenty
    messages cost its second before B's turn came."""
    a, b = f"holda{uuid.uuid4().hex[:6]}", f"holdb{uuid.uuid4().hex[:6]}"
    nc, js = await jetstream(bus, "test-hold")
    calls: dict[str, list[int]] = {a: [], b: []}
    handled_b: list[float] = []

    async def handler(_subject: str, msg: IterationBatch) -> None:
        calls[msg.job_id].append(msg.iteration[0])
        if msg.job_id == a:
            await asyncio.sleep(1.0)
            raise TransientError("the dependency timed out")
        handled_b.append(time.monotonic())

    spec = ConsumerSpec(stream=TELEMETRY, durable=f"hold-{a}", max_deliver=3,
                        retry_delays_s=(2.0,),
                        filter_subjects=(Subjects.iterations(a, "a1"), Subjects.iterations(b, "a1")))
    for it in range(20):
        await js.publish(Subjects.iterations(a, "a1"), batch(a, it).model_dump_json().encode())
    for it in range(5):
        await js.publish(Subjects.iterations(b, "a1"), batch(b, it).model_dump_json().encode())
    consumer: Consumer[IterationBatch] = Consumer(js, spec, IterationBatch, handler)
    t0 = time.monotonic()
    runner = asyncio.create_task(consumer.run())
    try:
        await until(lambda: len(handled_b) == 5, timeout_s=60, what="job B handled")
        waited = handled_b[-1] - t0
        # B waited for A's first failure only (1 s): 20 s without the hold; 8 s is a loaded
        # machine's margin
        assert waited < 8.0, f"job B waited {waited:.1f}s behind job A"
        assert calls[b] == [0, 1, 2, 3, 4]  # in order
        assert calls[a][:1] == [0] and consumer.stats.held >= 19
        await until(lambda: consumer.stats.dead_lettered == 20, timeout_s=120,
                    what="job A's messages dead-lettered after their deliveries")
    finally:
        consumer.stop()
        await asyncio.wait_for(runner, 60)
    letters = await letters_for(js, TELEMETRY, Subjects.iterations(a, "a1"))
    assert len(letters) == 20 and all(x.reason.startswith("retries_exhausted") for x in letters)
    assert len(calls[a]) <= 20 + 2  # A's head each round, then each message's last delivery
    await nc.drain()
