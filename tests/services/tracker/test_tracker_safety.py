"""The tracker never loses a detection and never observes a batch twice: a crash (no shutdown,
state saved long ago or never) is made good by reading the job's gap back from the stream; a
detection whose publish fails is kept and sent later while its batch is acked once; an idle job
leaves memory and comes back with its state; the state bucket has limits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import nats.errors
import pytest
from nats.js.api import ObjectStoreConfig
from nats.js.object_store import OBJ_STREAM_TEMPLATE

from services.common.bus import client
from services.common.bus.client import Consumer
from services.common.bus.contract import IterationBatch, Subjects
from services.common.bus.refusals import PermissionDenied, Refusal
from services.common.bus.streams import tracker_spec
from services.common.runtime import ServiceContext, start_service
from services.common.settings import Settings
from services.tracker.service import Tracker
from services.tracker.settings import TrackerSettings
from services.tracker.state_store import BUCKET, TrackerStateStore
from tests.conftest import Bus
from tests.services.tracker.test_tracker_service import (
    RANKS,
    _detections,
    _one_slowdown,
    _send,
    _series,
    _tracker,
    _until,
    own_bus,
)

__all__ = ["own_bus"]  # the fixture, shared with the other tracker tests


@asynccontextmanager
async def _crashing(bus: Bus, settings: Settings, **kw: Any
                    ) -> AsyncIterator[tuple[Tracker, Consumer[Any]]]:
    """A tracker that dies at the end: no final save, no drain (kill -9)."""
    ctx = await start_service("tracker", settings, need_db=False, backends=bus.backends("tracker"))
    store = await TrackerStateStore(ctx.js).open()
    tracker = Tracker(ctx, store=store, **{"settings": TrackerSettings(), **kw})
    consumer = tracker.consumer(tracker_spec(settings))
    task = asyncio.create_task(consumer.run(idle=tracker.tick))
    try:
        yield tracker, consumer
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await ctx.nc.close()


@pytest.mark.parametrize("crash_at", [102, 125])
def test_a_crash_mid_slowdown_loses_nothing_and_reports_once(own_bus: Bus, tmp_path: Path,
                                                             crash_at: int) -> None:
    """102: the slowdown began, nothing saved yet (a fresh detector would take the slow level
    for normal and never report it); 125: reported and saved with it, later batches not."""
    settings = Settings(nats_url=own_bus.url, data_dir=tmp_path)
    job = f"crash-{crash_at}"
    x = _series(200, slow_from=100, seed=crash_at)

    async def scenario() -> tuple[list[Any], Tracker]:
        async with _crashing(own_bus, settings, persist_every_s=1000.0) as (tracker, consumer):
            sent = await _send(own_bus, job, x, 0, crash_at)
            await _until(lambda: consumer.stats.handled >= sent)
        async with _tracker(own_bus, settings) as (tracker, consumer):
            sent = await _send(own_bus, job, x, crash_at, 200)
            await _until(lambda: consumer.stats.handled >= sent)
            assert tracker.jobs[job].slow
            replayed = tracker
        return await _detections(own_bus, job), replayed

    events, second = asyncio.run(scenario())
    assert 100 <= _one_slowdown(events).first_iteration <= 103
    assert second.stats.replayed > 0
    # every iteration observed once, none twice: the rounds run (restored and new) and the
    # values still queued add up to the 200 sent
    t = second.jobs[job]
    assert t.rounds + int(t._queue.counts[0]) == 200


def test_a_failed_detection_publish_is_retried_and_its_batch_observed_once(
        own_bus: Bus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(nats_url=own_bus.url, data_dir=tmp_path)
    job = "pubfail"
    x = _series(160, slow_from=100, seed=5)
    real = client.publish
    failures: list[str] = []

    async def once_down(js: Any, subject: str, msg: Any) -> None:
        if not failures:
            failures.append(msg.event_id)
            raise nats.errors.TimeoutError
        await real(js, subject, msg)

    monkeypatch.setattr("services.tracker.service.publish", once_down)

    async def scenario() -> tuple[list[Any], Tracker, Consumer[Any]]:
        async with _tracker(own_bus, settings) as (tracker, consumer):
            sent = await _send(own_bus, job, x, 0, 160)
            await _until(lambda: consumer.stats.handled >= sent)
            await _until(lambda: not tracker.state[job].pending)
            return await _detections(own_bus, job), tracker, consumer

    events, tracker, consumer = asyncio.run(scenario())
    assert _one_slowdown(events) and events[0].event_id == failures[0]
    assert tracker.stats.handover_failures == 1
    assert consumer.stats.dead_lettered == 0 and consumer.stats.retried == 0
    assert tracker.jobs[job].updates == RANKS * 160  # each value once


def test_an_idle_job_leaves_memory_and_comes_back_with_its_state(own_bus: Bus,
                                                                 tmp_path: Path) -> None:
    settings = Settings(nats_url=own_bus.url, data_dir=tmp_path)
    job = "idle"
    x = _series(200, slow_from=100, seed=8)

    async def scenario() -> None:
        ctx = await start_service("tracker", settings, need_db=False,
                                  backends=own_bus.backends("tracker"))
        store = await TrackerStateStore(ctx.js).open()
        tracker = Tracker(ctx, store=store,
                          settings=TrackerSettings(tracker_idle_evict_s=0.5))
        consumer = tracker.consumer(tracker_spec(settings))
        task = asyncio.create_task(consumer.run(idle=tracker.tick))
        try:
            sent = await _send(own_bus, job, x, 0, 130)
            await _until(lambda: consumer.stats.handled >= sent)
            assert tracker.jobs[job].slow
            await _until(lambda: job not in tracker.state, timeout_s=30)
            assert tracker.stats.evicted == 1
            saved = await store.load(job)
            assert saved is not None and saved["tracker"]["slow"] is True
            sent += await _send(own_bus, job, x, 130, 140)
            await _until(lambda: consumer.stats.handled >= sent)
            assert tracker.jobs[job].slow  # back, with what it knew
        finally:
            consumer.stop()
            await task
            await ctx.close()
        events = await _detections(own_bus, job)
        _one_slowdown(events)

    asyncio.run(scenario())


def test_the_state_bucket_gets_its_limits_even_when_it_existed(own_bus: Bus) -> None:
    async def scenario() -> None:
        settings = Settings(nats_url=own_bus.url)
        ctx = await start_service("tracker", settings, need_db=False,
                                  backends=own_bus.backends("tracker"))
        try:
            await ctx.js.create_object_store(BUCKET, config=ObjectStoreConfig(
                bucket=BUCKET))  # as older trackers made it: no limits
            store = await TrackerStateStore(ctx.js, BUCKET, ttl_s=3600.0,
                                            max_bytes=64 << 20).open()
            info = await ctx.js.stream_info(OBJ_STREAM_TEMPLATE.format(bucket=BUCKET))
            assert info.config.max_age == 3600.0 and info.config.max_bytes == 64 << 20
            await store.save("j", {"x": 1})
            assert await store.load("j") == {"x": 1}
        finally:
            await ctx.close()

    asyncio.run(scenario())


class _Unreadable(TrackerStateStore):
    """A state bucket whose objects cannot be read back, for the reason given."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def load(self, job: str) -> dict[str, Any] | None:
        raise self.exc

    async def save(self, job: str, state: dict[str, Any]) -> None:
        return None


def _iteration_batch(job: str) -> IterationBatch:
    return IterationBatch(job_id=job, agent_id="a0", rank=[0, 1], iteration=[1, 1],
                          end_ns=[1, 1], duration_s=[0.1, 0.1])


async def test_a_saved_state_no_retry_can_read_starts_the_job_afresh() -> None:
    """The bus refusing the read (or an object that does not decode): the job is tracked from
    here, not every one of its messages failed in turn."""
    ctx = cast(ServiceContext, SimpleNamespace(sessions=None, js=None))
    refused = PermissionDenied(Refusal("publish", "$js.api.stream.names", 0.0), "tracker")
    tracker = Tracker(ctx, store=_Unreadable(refused), settings=TrackerSettings())
    await tracker.handle(Subjects.iterations("unread", "a0"), _iteration_batch("unread"))
    assert tracker.jobs["unread"].updates == 2 and tracker.stats.corrupt_states == 1
    flaky = Tracker(ctx, store=_Unreadable(nats.errors.TimeoutError()),
                    settings=TrackerSettings())
    with pytest.raises(nats.errors.TimeoutError):  # the bus slow: retried, the job held
        await flaky.handle(Subjects.iterations("slow", "a0"), _iteration_batch("slow"))
    assert "slow" not in flaky.jobs
