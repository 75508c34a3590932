"""The tracker over a real nats-server: restart mid-slowdown, and jobs split across partitions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from nats.js import JetStreamContext

from services.common.bus.auth import agent_user
from services.common.bus.client import Consumer, publish
from services.common.bus.contract import DetectionEvent, IterationBatch, Subjects
from services.common.bus.streams import EVENTS, tracker_spec
from services.common.runtime import start_service
from services.common.settings import Settings
from services.tracker.service import Tracker
from services.tracker.settings import TrackerSettings
from services.tracker.state_store import TrackerStateStore
from tests.conftest import Bus, new_bus

RANKS = 8


@pytest.fixture()
def own_bus() -> Iterator[Bus]:
    """A private bus per test: these tests bind the tracker's durables, which the e2e stack also
    uses, and restart trackers on its saved state."""
    with new_bus("gh-trk-") as b:
        yield b


def _series(iterations: int, slow_from: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = 0.1 * (1.0 + 0.01 * rng.standard_normal((RANKS, iterations)))
    x[:, slow_from:] *= 1.5
    return x


async def _send(bus: Bus, job: str, x: np.ndarray, start: int, stop: int) -> int:
    """One message per two iterations of all ranks, as agent a0 flushes them; returns messages
    sent."""
    async with _agent(bus) as js:
        return await _send_js(js, job, x, start, stop)


@asynccontextmanager
async def _agent(bus: Bus) -> AsyncIterator[JetStreamContext]:
    nc = await bus.connect(agent_user("a0"))
    try:
        yield nc.jetstream()
    finally:
        await nc.close()


async def _send_js(js: JetStreamContext, job: str, x: np.ndarray, start: int, stop: int,
                   numbers: np.ndarray | None = None) -> int:
    """``numbers``: each rank's iteration numbers as its agent counts them (default: the
    column)."""
    sent = 0
    for it in range(start, stop, 2):
        its = list(range(it, min(it + 2, stop)))
        rank = [r for r in range(RANKS) for _ in its]
        iteration = [i for _ in range(RANKS) for i in its]
        counted = iteration if numbers is None else [int(numbers[r, i]) for r, i in
                                                     zip(rank, iteration, strict=True)]
        msg = IterationBatch(job_id=job, agent_id="a0", rank=rank, iteration=counted,
                             end_ns=[i * 100_000_000 for i in iteration],
                             duration_s=[float(x[r, i]) for r, i in zip(rank, iteration,
                                                                         strict=True)])
        await publish(js, Subjects.iterations(job, "a0"), msg)
        sent += 1
    return sent


@asynccontextmanager
async def _tracker(bus: Bus, settings: Settings) -> AsyncIterator[tuple[Tracker, Consumer[Any]]]:
    """A running tracker (its consumer in a task); stopped the way run_tracker stops it."""
    ctx = await start_service("tracker", settings, need_db=False, backends=bus.backends("tracker"))
    store = await TrackerStateStore(ctx.js).open()
    tracker = Tracker(ctx, store=store, settings=TrackerSettings())
    consumer = tracker.consumer(tracker_spec(settings))
    task = asyncio.create_task(consumer.run(idle=tracker.tick))
    try:
        yield tracker, consumer
    finally:
        consumer.stop()
        await task
        await tracker.persist()
        await ctx.close()


async def _until(cond: Any, timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not cond():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.02)


def _stages(events: list[DetectionEvent]) -> list[tuple[str, str, str]]:
    """Each event's kind, change and stage."""
    return [(e.kind, str(e.evidence.get("change")), e.stage) for e in events]


SUSPECTED_THEN_CONFIRMED = [("slowdown", "onset", "suspected"), ("slowdown", "onset", "confirmed")]


def _one_slowdown(events: list[DetectionEvent]) -> DetectionEvent:
    """A slowdown reported once per stage, the confirmation saying when it was suspected."""
    assert _stages(events) == SUSPECTED_THEN_CONFIRMED, events
    suspected, confirmed = events
    assert confirmed.suspected_iteration == suspected.detected_iteration
    assert confirmed.suspected_ns == suspected.detected_ns == suspected.suspected_ns
    assert confirmed.detected_iteration > suspected.detected_iteration
    assert confirmed.confirms == suspected.event_id and suspected.confirms is None
    return confirmed


async def _detections(bus: Bus, job: str) -> list[DetectionEvent]:
    """What the tracker published for ``job``, read by the operator."""
    nc = await bus.connect()
    sub = await nc.jetstream().pull_subscribe(Subjects.detection(job), stream=EVENTS)
    out: list[DetectionEvent] = []
    try:
        while True:
            msgs = await sub.fetch(100, timeout=0.5)
            out += [DetectionEvent.model_validate_json(m.data) for m in msgs]
    except TimeoutError:
        pass
    await sub.unsubscribe()  # a pull subscription left open holds the drain for its timeout
    await nc.close()
    return out


@pytest.mark.parametrize("restart_at", [102, 125])
def test_restart_mid_slowdown_reports_it_once(own_bus: Bus, tmp_path: Path,
                                              restart_at: int) -> None:
    """102: the slowdown began but was not yet confirmed; 125: it was already reported."""
    settings = Settings(nats_url=own_bus.url, data_dir=tmp_path)
    job = f"restart-{restart_at}"
    x = _series(200, slow_from=100, seed=restart_at)

    async def scenario() -> list[DetectionEvent]:
        async with _tracker(own_bus, settings) as (tracker, consumer):
            sent = await _send(own_bus, job, x, 0, restart_at)
            await _until(lambda: consumer.stats.handled >= sent)
        async with _tracker(own_bus, settings) as (tracker, consumer):
            sent = await _send(own_bus, job, x, restart_at, 200)
            await _until(lambda: consumer.stats.handled >= sent)
            assert tracker.jobs[job].slow
        return await _detections(own_bus, job)

    events = asyncio.run(scenario())
    slow = _one_slowdown(events)
    assert 100 <= slow.first_iteration <= 103
    assert slow.after_s / slow.before_s == pytest.approx(1.5, rel=0.05)


def test_partitions_share_the_jobs_each_job_on_one_tracker(tmp_path: Path) -> None:
    jobs = [f"job-{k}" for k in range(8)]
    x = _series(20, slow_from=20, seed=7)

    async def scenario(bus: Bus) -> list[set[str]]:
        parts = [Settings(nats_url=bus.url, data_dir=tmp_path, tracker_partitions=2,
                          tracker_partition=i) for i in range(2)]
        async with _tracker(bus, parts[0]) as (t0, c0), _tracker(bus, parts[1]) as (t1, c1):
            sent = 0
            for job in jobs:
                sent += await _send(bus, job, x, 0, 20)
            await _until(lambda: c0.stats.handled + c1.stats.handled >= sent)
            await asyncio.sleep(0.3)  # nothing else may arrive: each message went to one tracker
            assert c0.stats.handled + c1.stats.handled == sent
            assert c0.spec.durable != c1.spec.durable
            return [set(t0.jobs), set(t1.jobs)]

    with new_bus("gh-trk-parts-", tracker_partitions=2) as bus:  # grants for two partitions
        owned = asyncio.run(scenario(bus))
    assert owned[0] and owned[1], owned
    assert not owned[0] & owned[1]
    assert owned[0] | owned[1] == set(jobs)


def test_a_second_fault_is_a_detection_of_its_own(own_bus: Bus, tmp_path: Path) -> None:
    """Slow from 100 (x1.5), slower from 200 (x1.3 more), back to the first level at 300: the
    tracker publishes the onset, the further slowdown and the partial recovery, each with the
    levels either side and the healthy one; a restart in between changes nothing."""
    settings = Settings(nats_url=own_bus.url, data_dir=tmp_path)
    job = "second-fault"
    x = _series(360, slow_from=100, seed=11)
    x[:, 200:300] *= 1.3

    async def scenario() -> list[DetectionEvent]:
        async with _tracker(own_bus, settings) as (_, consumer):
            sent = await _send(own_bus, job, x, 0, 230)
            await _until(lambda: consumer.stats.handled >= sent)
        async with _tracker(own_bus, settings) as (_, consumer):
            sent = await _send(own_bus, job, x, 230, 360)
            await _until(lambda: consumer.stats.handled >= sent)
        return await _detections(own_bus, job)

    events = asyncio.run(scenario())
    assert _stages(events) == [
        *SUSPECTED_THEN_CONFIRMED, ("slowdown", "further", "suspected"),
        ("slowdown", "further", "confirmed"), ("recovery", "partial", "confirmed")], events
    onset, further, partial = events[1], events[3], events[4]
    assert 200 <= further.first_iteration <= 203 and 300 <= partial.first_iteration <= 303
    assert further.before_s == pytest.approx(onset.after_s, rel=0.03)
    assert further.after_s / further.before_s == pytest.approx(1.3, rel=0.03)
    assert partial.after_s == pytest.approx(onset.after_s, rel=0.03)
    assert all(e.evidence["healthy_s"] == pytest.approx(0.1, rel=0.02) for e in events)
    assert len({e.event_id for e in events}) == 5


def test_a_jobs_warm_up_and_a_rank_restart_raise_no_slowdown(own_bus: Bus, tmp_path: Path) -> None:
    """Issue 18 at the tracker: a job whose first 40 iterations come at a fifth of its time (a
    pipeline filling), then half its ranks restarting at iteration 200 (their agent counts from
    0 again) and warming up the same way, raises nothing; a slowdown at 300 is still found."""
    settings = Settings(nats_url=own_bus.url, data_dir=tmp_path)
    job = "warm-restart"
    x = _series(360, slow_from=300, seed=3)
    x[:, :40] *= 0.2
    x[4:, 200:240] *= 0.2
    numbers = np.tile(np.arange(360), (RANKS, 1))
    numbers[4:, 200:] -= 200

    async def scenario() -> list[DetectionEvent]:
        async with _tracker(own_bus, settings) as (_, consumer), _agent(own_bus) as js:
            sent = await _send_js(js, job, x, 0, 300, numbers)
            await _until(lambda: consumer.stats.handled >= sent)
            assert await _detections(own_bus, job) == []
            sent += await _send_js(js, job, x, 300, 360, numbers)
            await _until(lambda: consumer.stats.handled >= sent)
        return await _detections(own_bus, job)

    slow = _one_slowdown(asyncio.run(scenario()))
    assert 300 <= slow.first_iteration <= 302
