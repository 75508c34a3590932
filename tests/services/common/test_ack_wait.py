"""What the real server does with a ConsumerSpec: the ack wait it states, no hidden BackOff, and
redelivery after a nak only once the spec's retry delay has passed.

Timing checks are one-sided where it matters ("not before"): a loaded machine only delays
deliveries, so "nothing came before X" cannot fail by load, and "it came" waits generously.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
import uuid

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from services.common.bus.client import Consumer, TransientError
from services.common.bus.contract import IterationBatch, Subjects, Suspicion
from services.common.bus.streams import EVENTS, TELEMETRY, VALIDATOR, ConsumerSpec
from tests.conftest import Bus
from tests.services.common.support import batch, jetstream, until


async def test_validator_gets_the_ack_wait_its_spec_states(bus: Bus) -> None:
    """The validator's consumer as the server holds it, including one created by the old spec
    (120 s ack wait with a BackOff list, which made the server's first ack wait 1 s)."""
    nc, js = await jetstream(bus, "test-ackwait-spec")
    spec = dataclasses.replace(VALIDATOR, durable=f"validator-{uuid.uuid4().hex[:8]}")
    await js.add_consumer(EVENTS, ConsumerConfig(
        durable_name=spec.durable, name=spec.durable, deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.EXPLICIT, ack_wait=120.0, max_deliver=5,
        backoff=[1.0, 5.0, 15.0, 30.0], filter_subjects=list(spec.filter_subjects)))
    assert (await js.consumer_info(EVENTS, spec.durable)).config.backoff == [1.0, 5.0, 15.0, 30.0]

    async def handler(_subject: str, _msg: object) -> None:
        pass

    sub = await Consumer(js, spec, Suspicion, handler).bind()
    await sub.unsubscribe()
    config = (await js.consumer_info(EVENTS, spec.durable)).config
    assert config.ack_wait == 120.0 and not config.backoff
    assert config.max_deliver == -1 and spec.batch == 1  # the old bound lifted on update
    await js.delete_consumer(EVENTS, spec.durable)
    await nc.drain()


async def test_unacked_message_comes_back_after_ack_wait_not_sooner(bus: Bus) -> None:
    job = f"ackw{uuid.uuid4().hex[:8]}"
    subject = Subjects.iterations(job, "a1")
    nc, js = await jetstream(bus, "test-ackwait")
    spec = ConsumerSpec(stream=TELEMETRY, durable=f"ackw-{job}", filter_subjects=(subject,),
                        ack_wait_s=3.0, retry_delays_s=(0.2,))

    async def handler(_subject: str, _msg: object) -> None:
        pass

    sub = await Consumer(js, spec, IterationBatch, handler).bind()
    await js.publish(subject, batch(job).model_dump_json().encode())
    [first] = await sub.fetch(1, timeout=10)
    got_at = time.monotonic()  # neither acked nor naked: a hung handler, or a dead process
    early: list[int] = []
    while time.monotonic() - got_at < 2.0:  # the old BackOff would redeliver after 1 s
        with contextlib.suppress(TimeoutError):
            early += [m.metadata.num_delivered for m in await sub.fetch(1, timeout=0.25)]
    assert early == []
    [again] = await sub.fetch(1, timeout=20)
    assert again.metadata.num_delivered == 2
    await again.ack()
    await sub.unsubscribe()
    assert first.metadata.sequence.stream == again.metadata.sequence.stream
    await nc.drain()


async def test_transient_failure_is_retried_after_the_spec_delay(bus: Bus) -> None:
    job = f"nakd{uuid.uuid4().hex[:8]}"
    subject = Subjects.iterations(job, "a1")
    nc, js = await jetstream(bus, "test-nakdelay")
    calls: list[float] = []

    async def handler(_subject: str, _msg: IterationBatch) -> None:
        calls.append(time.monotonic())
        if len(calls) <= 2:
            raise TransientError("busy")

    spec = ConsumerSpec(stream=TELEMETRY, durable=f"nakd-{job}", filter_subjects=(subject,),
                        ack_wait_s=30.0, retry_delays_s=(1.0, 2.0))
    consumer: Consumer[IterationBatch] = Consumer(js, spec, IterationBatch, handler)
    runner = asyncio.create_task(consumer.run())
    try:
        await js.publish(subject, batch(job).model_dump_json().encode())
        await until(lambda: consumer.stats.handled == 1, what="the third delivery handled")
    finally:
        consumer.stop()
        await asyncio.wait_for(runner, 20)
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    assert len(calls) == 3 and consumer.stats.retried == 2
    assert gaps[0] >= 1.0 - 0.05 and gaps[1] >= 2.0 - 0.05  # delay n follows delivery n
    await nc.drain()
