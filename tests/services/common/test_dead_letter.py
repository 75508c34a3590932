"""Bad messages on the real nats-server are terminated, dead-lettered with a reason and counted,
and the consumer goes on handling good ones."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from services.common.bus.client import Consumer, ensure_streams
from services.common.bus.contract import DeadLetter, IterationBatch, Subjects
from services.common.bus.streams import DEAD_LETTERS, TELEMETRY, ConsumerSpec
from services.common.settings import Settings
from tests.conftest import Bus


def _good(job: str) -> IterationBatch:
    return IterationBatch(job_id=job, agent_id="a1", rank=[0, 1], iteration=[5, 5],
                          end_ns=[1, 2], duration_s=[0.1, 0.1])


async def test_bad_messages_are_dead_lettered(bus: Bus) -> None:
    job = f"dlq{uuid.uuid4().hex[:8]}"
    nc = await bus.connect(name="test-dlq")
    js = nc.jetstream()
    await ensure_streams(js, Settings())
    subject = Subjects.iterations(job, "a1")
    handled: list[IterationBatch] = []

    async def handler(_subject: str, msg: IterationBatch) -> None:
        handled.append(msg)

    spec = ConsumerSpec(stream=TELEMETRY, durable=f"dlqtest-{job}", filter_subjects=(subject,))
    consumer: Consumer[IterationBatch] = Consumer(js, spec, IterationBatch, handler)
    runner = asyncio.create_task(consumer.run())

    good = _good(job).model_dump()
    wrong_version = {**good, "schema_version": 2}
    missing = {k: v for k, v in good.items() if k != "duration_s"}
    ragged = {**good, "rank": [0]}
    await js.publish(subject, b"{not json")
    await js.publish(subject, json.dumps(wrong_version).encode())
    await js.publish(subject, json.dumps(missing).encode())
    await js.publish(subject, json.dumps(ragged).encode())
    await js.publish(subject, _good(job).model_dump_json().encode())

    for _ in range(100):
        if consumer.stats.dead_lettered == 4 and len(handled) == 1:
            break
        await asyncio.sleep(0.05)
    consumer.stop()
    await runner

    assert len(handled) == 1 and handled[0].rank == [0, 1]
    assert consumer.stats.dead_lettered == 4
    assert consumer.stats.reasons == {"invalid_json": 1, "schema": 3}

    dlq = await js.pull_subscribe(Subjects.dead_letter(TELEMETRY), durable=None, stream=DEAD_LETTERS)
    letters: list[DeadLetter] = []
    for m in await dlq.fetch(50, timeout=2):
        letter = DeadLetter.model_validate_json(m.data)
        if letter.subject == subject:
            letters.append(letter)
    reasons = sorted(letter.reason for letter in letters)
    assert len(letters) == 4
    assert reasons[0].startswith("invalid_json")
    assert any("schema_version" in r for r in reasons)
    assert any("duration_s" in r and "Field required" in r for r in reasons)
    assert any("equal lengths" in r for r in reasons)
    assert all(letter.consumer == spec.durable for letter in letters)

    # Terminated messages are not redelivered: a fresh run of the consumer sees nothing new.
    consumer2: Consumer[IterationBatch] = Consumer(js, spec, IterationBatch, handler)
    runner2 = asyncio.create_task(consumer2.run())
    await asyncio.sleep(0.6)
    consumer2.stop()
    await runner2
    assert consumer2.stats.handled == 0 and consumer2.stats.dead_lettered == 0
    await nc.drain()


async def test_handler_crash_is_dead_lettered_not_fatal(bus: Bus) -> None:
    job = f"crash{uuid.uuid4().hex[:8]}"
    nc = await bus.connect(name="test-crash")
    js = nc.jetstream()
    await ensure_streams(js, Settings())
    subject = Subjects.iterations(job, "a1")
    seen: list[int] = []

    async def handler(_subject: str, msg: IterationBatch) -> None:
        seen.append(msg.iteration[0])
        if msg.iteration[0] == 1:
            raise ValueError("boom")

    spec = ConsumerSpec(stream=TELEMETRY, durable=f"crash-{job}", filter_subjects=(subject,))
    consumer: Consumer[IterationBatch] = Consumer(js, spec, IterationBatch, handler)
    runner = asyncio.create_task(consumer.run())
    for it in (1, 2):
        batch = IterationBatch(job_id=job, agent_id="a1", rank=[0], iteration=[it], end_ns=[0],
                               duration_s=[0.1])
        await js.publish(subject, batch.model_dump_json().encode())
    for _ in range(100):
        if len(seen) >= 2:
            break
        await asyncio.sleep(0.05)
    consumer.stop()
    await runner
    assert seen == [1, 2]
    assert consumer.stats.handled == 1
    assert consumer.stats.reasons == {"handler_error": 1}
    await nc.drain()


def test_subject_tokens_are_checked() -> None:
    with pytest.raises(ValueError, match="subject token"):
        Subjects.iterations("bad.job", "a1")
    assert Subjects.job_of(Subjects.iterations("j-1", "a1")) == "j-1"
