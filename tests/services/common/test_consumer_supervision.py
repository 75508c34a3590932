"""Nothing stops a consumer silently: a failing idle task or ack is counted and consuming goes
on; a consumer that cannot go on ends loudly, and supervise() takes the service down with it."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import nats.errors as nats_errors
import pytest
from nats.aio.msg import Msg

from services.common.bus.client import Consumer, ConsumerLost
from services.common.bus.contract import IterationBatch, Subjects
from services.common.bus.streams import TELEMETRY, ConsumerSpec
from services.common.runtime import SupervisedTaskCancelled, supervise
from tests.conftest import Bus
from tests.services.common.support import batch, jetstream, until


def _spec(job: str, subject: str, **kw: Any) -> ConsumerSpec:
    return ConsumerSpec(stream=TELEMETRY, durable=f"sup-{job}", filter_subjects=(subject,), **kw)


async def test_failing_idle_does_not_stop_consumption(bus: Bus) -> None:
    job = f"idle{uuid.uuid4().hex[:8]}"
    subject = Subjects.iterations(job, "a1")
    nc, js = await jetstream(bus, "test-idle")
    seen: list[int] = []
    ticks = 0

    async def handler(_subject: str, msg: IterationBatch) -> None:
        seen.append(msg.iteration[0])

    async def idle() -> None:
        nonlocal ticks
        ticks += 1
        if ticks % 2:
            raise RuntimeError("tick failed")

    consumer: Consumer[IterationBatch] = Consumer(js, _spec(job, subject), IterationBatch, handler)
    runner = asyncio.create_task(consumer.run(idle=idle))
    try:
        await until(lambda: consumer.stats.idle_failures >= 2, what="idle failing")
        for it in (1, 2, 3):
            await js.publish(subject, batch(job, it).model_dump_json().encode())
        await until(lambda: len(seen) == 3, what="the messages after idle failures")
        await until(lambda: consumer.stats.idle_failures >= 4, what="idle still running")
        assert seen == [1, 2, 3]
        assert not runner.done()
    finally:
        consumer.stop()
        await asyncio.wait_for(runner, 20)
    await nc.drain()


async def test_failed_ack_is_counted_and_the_message_comes_back(
        bus: Bus, monkeypatch: pytest.MonkeyPatch) -> None:
    job = f"ack{uuid.uuid4().hex[:8]}"
    subject = Subjects.iterations(job, "a1")
    nc, js = await jetstream(bus, "test-ack")
    seen: list[int] = []
    real_ack = Msg.ack
    failed_once: list[str] = []

    async def flaky_ack(self: Msg) -> None:
        if self.subject == subject and not failed_once:
            failed_once.append(self.subject)
            raise nats_errors.ConnectionClosedError()
        await real_ack(self)

    monkeypatch.setattr(Msg, "ack", flaky_ack)

    async def handler(_subject: str, msg: IterationBatch) -> None:
        seen.append(msg.iteration[0])

    spec = _spec(job, subject, ack_wait_s=1.0)
    consumer: Consumer[IterationBatch] = Consumer(js, spec, IterationBatch, handler)
    runner = asyncio.create_task(consumer.run())
    try:
        await js.publish(subject, batch(job, 1).model_dump_json().encode())
        await until(lambda: consumer.stats.settle_failures == 1, what="the failed ack")
        await js.publish(subject, batch(job, 2).model_dump_json().encode())
        # At least once: the unacked message is delivered again after the ack wait.
        await until(lambda: sorted(seen) == [1, 1, 2], what="the redelivery")
        assert consumer.stats.handled == 3 and not runner.done()
    finally:
        consumer.stop()
        await asyncio.wait_for(runner, 20)
    await nc.drain()


class _BrokenHandle(Consumer[IterationBatch]):
    """An override of handle() that fails outside the handler once (like a feed that acks)."""

    broke = False

    async def handle(self, msg: Msg) -> None:
        if not self.broke:
            self.broke = True
            raise RuntimeError("override failed")
        await super().handle(msg)


async def test_failing_handle_override_is_counted(bus: Bus) -> None:
    job = f"ovr{uuid.uuid4().hex[:8]}"
    subject = Subjects.iterations(job, "a1")
    nc, js = await jetstream(bus, "test-override")
    seen: list[int] = []

    async def handler(_subject: str, msg: IterationBatch) -> None:
        seen.append(msg.iteration[0])

    consumer = _BrokenHandle(js, _spec(job, subject, ack_wait_s=1.0), IterationBatch, handler)
    runner = asyncio.create_task(consumer.run())
    try:
        await js.publish(subject, batch(job, 5).model_dump_json().encode())
        await until(lambda: seen == [5], what="the redelivered message")
        assert consumer.stats.handle_failures == 1 and not runner.done()
    finally:
        consumer.stop()
        await asyncio.wait_for(runner, 20)
    await nc.drain()


async def test_deleted_consumer_ends_the_service_loudly(bus: Bus) -> None:
    """The durable deleted under a running consumer: fetch alone would just see silence."""
    job = f"gone{uuid.uuid4().hex[:8]}"
    subject = Subjects.iterations(job, "a1")
    nc, js = await jetstream(bus, "test-gone")

    async def handler(_subject: str, msg: IterationBatch) -> None:
        pass

    spec = _spec(job, subject)
    consumer: Consumer[IterationBatch] = Consumer(js, spec, IterationBatch, handler, liveness_s=0.5)
    stop = asyncio.Event()
    stopper_cancelled = asyncio.Event()

    async def wait_for_stop() -> None:
        try:
            await stop.wait()
        except asyncio.CancelledError:
            stopper_cancelled.set()
            raise

    service = asyncio.create_task(supervise(consumer.run(), wait_for_stop()))
    await until(lambda: consumer.stats.fetch_failures == 0 and consumer._checked_at > 0,
                what="the consumer bound")
    await js.delete_consumer(TELEMETRY, spec.durable)
    with pytest.raises(ConsumerLost, match="no longer exists"):
        await asyncio.wait_for(service, 20)
    assert stopper_cancelled.is_set()
    await nc.drain()


async def test_bind_to_a_missing_stream_fails_at_once(bus: Bus) -> None:
    nc, js = await jetstream(bus, "test-nostream")

    async def handler(_subject: str, msg: IterationBatch) -> None:
        pass

    spec = ConsumerSpec(stream="NO_SUCH_STREAM", durable="nobody", filter_subjects=("x.y",))
    consumer: Consumer[IterationBatch] = Consumer(js, spec, IterationBatch, handler)
    with pytest.raises(ConsumerLost, match="cannot bind"):
        await asyncio.wait_for(consumer.run(), 20)
    await nc.drain()


async def test_supervise_returns_when_all_finish() -> None:
    done: list[str] = []

    async def finish(name: str) -> None:
        await asyncio.sleep(0.01)
        done.append(name)

    await asyncio.wait_for(supervise(finish("a"), finish("b")), 10)
    assert sorted(done) == ["a", "b"]


async def test_supervise_first_death_cancels_the_others() -> None:
    cancelled = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def dies() -> None:
        await asyncio.sleep(0.01)
        raise ValueError("consumer died")

    with pytest.raises(ValueError, match="consumer died"):
        await asyncio.wait_for(supervise(forever(), dies()), 10)
    assert cancelled.is_set()


async def test_supervise_treats_an_outside_cancel_as_death() -> None:
    victim = asyncio.create_task(asyncio.sleep(3600))
    other = asyncio.create_task(asyncio.sleep(3600))
    supervisor = asyncio.create_task(supervise(victim, other))
    await asyncio.sleep(0.01)
    victim.cancel()
    with pytest.raises(SupervisedTaskCancelled):
        await asyncio.wait_for(supervisor, 10)
    assert other.cancelled()


async def test_cancelling_supervise_cancels_every_task() -> None:
    tasks = [asyncio.create_task(asyncio.sleep(3600)) for _ in range(3)]
    supervisor = asyncio.create_task(supervise(*tasks))
    await asyncio.sleep(0.01)
    supervisor.cancel()
    with pytest.raises(asyncio.CancelledError):
        await supervisor
    assert all(t.cancelled() for t in tasks)
