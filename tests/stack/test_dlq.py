"""``greyhound dlq list|replay`` on the authenticated embedded NATS of a data directory (as the
``operator`` user it hands out): a message whose tries ran out is listed with its reason; once
what failed it is fixed, replaying it hands it to the consumer again, which handles it once,
and the letter leaves the stream."""

from __future__ import annotations

import argparse
import asyncio
import io
import uuid

from services.common.bus.client import Consumer, TransientError
from services.common.bus.contract import IterationBatch, Subjects
from services.common.bus.streams import TELEMETRY, ConsumerSpec
from services.common.settings import Settings
from stack.dlq import _run
from tests.conftest import Bus
from tests.services.common.support import batch, jetstream, until


def _args(command: str, **over: object) -> argparse.Namespace:
    base: dict[str, object] = {"dlq_command": command, "stream": TELEMETRY, "consumer": None,
                               "reason": None, "seq": []}
    return argparse.Namespace(**{**base, **over})


async def _dlq(bus: Bus, command: str, **over: object) -> tuple[int, str]:
    out = io.StringIO()
    rc = await _run(Settings(data_dir=bus.data_dir), _args(command, **over), out)
    return rc, out.getvalue()


async def test_a_dead_letter_is_listed_then_replayed_once(bus: Bus) -> None:
    job = f"dlq{uuid.uuid4().hex[:8]}"
    subject = Subjects.iterations(job, "a1")
    nc, js = await jetstream(bus, "test-dlq")
    fixed = asyncio.Event()
    handled: list[str] = []

    async def handler(_subject: str, msg: IterationBatch) -> None:
        if not fixed.is_set():
            raise TransientError("a dependency of this handler is misconfigured")
        handled.append(msg.event_id)

    spec = ConsumerSpec(stream=TELEMETRY, durable=f"dlq-{job}", filter_subjects=(subject,),
                        max_deliver=2, retry_delays_s=(0.1,))
    consumer: Consumer[IterationBatch] = Consumer(js, spec, IterationBatch, handler)
    runner = asyncio.create_task(consumer.run())
    try:
        sent = batch(job, 5)
        await js.publish(subject, sent.model_dump_json().encode())
        await until(lambda: consumer.stats.dead_lettered == 1, what="the dead letter")
        rc, listed = await _dlq(bus, "list", consumer=spec.durable)
        (line,) = listed.splitlines()
        assert rc == 0 and subject in line and "retries_exhausted" in line, listed
        seq = int(line.split()[0])

        fixed.set()
        rc, replayed = await _dlq(bus, "replay", consumer=spec.durable, seq=[seq])
        assert rc == 0 and f"replayed {seq}" in replayed, replayed
        await until(lambda: handled == [sent.event_id], what="the replayed message handled")
        assert (await _dlq(bus, "list", consumer=spec.durable))[1] == ""  # the letter is gone
        rc, again = await _dlq(bus, "replay", consumer=spec.durable, seq=[seq])
        assert rc == 0 and again == ""  # nothing left to replay
        await asyncio.sleep(0.5)
        assert handled == [sent.event_id] and consumer.stats.dead_lettered == 1
    finally:
        consumer.stop()
        await asyncio.wait_for(runner, 20)
        await nc.drain()
