"""The short-lived telemetry reader the API, the tracker's replay and the planner's iteration
watch share: it starts where asked (a time or a sequence), sees only its subject, and leaves no
consumer behind once closed, even when binding fails."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import nats.js.errors
import pytest

from services.common.bus.auth import agent_user
from services.common.bus.client import BusClient, publish
from services.common.bus.contract import IterationBatch, Subjects
from services.common.bus.reader import TelemetryReader
from services.common.bus.streams import TELEMETRY
from services.common.runtime import ServiceContext, start_service
from services.common.settings import Settings
from services.planner.iterations import IterationWatch
from tests.conftest import Bus


@pytest.fixture()
async def ctx(own_bus: Bus, tmp_path: Path) -> AsyncIterator[ServiceContext]:
    """The API's connection: one of the services that read telemetry."""
    c = await start_service("api", Settings(nats_url=own_bus.url, data_dir=tmp_path),
                            need_db=False, backends=own_bus.backends("api"))
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture()
async def agent(own_bus: Bus) -> AsyncIterator[BusClient]:
    """The agent whose telemetry is read."""
    nc = await own_bus.connect(agent_user("a0"))
    try:
        yield nc
    finally:
        await nc.close()


async def _batches(agent: BusClient, job: str, n: int) -> None:
    for i in range(n):
        await publish(agent.jetstream(), Subjects.iterations(job, "a0"), IterationBatch(
            job_id=job, agent_id="a0", rank=[0], iteration=[i], end_ns=[(i + 1) * 10**8],
            duration_s=[0.1 + i / 100]))


async def _read_all(reader: TelemetryReader) -> list[tuple[int, IterationBatch]]:
    """(stream sequence, batch) of everything the reader gets."""
    out: list[tuple[int, IterationBatch]] = []
    for _ in range(20):  # bounded: a few fetches bring everything on a loaded machine
        try:
            msgs = await reader.sub.fetch(16, timeout=0.5)
        except (TimeoutError, nats.errors.TimeoutError):
            break
        out += [(m.metadata.sequence.stream, IterationBatch.model_validate_json(m.data))
                for m in msgs]
    return out


async def test_reads_from_a_time_or_a_sequence_and_cleans_up(ctx: ServiceContext, agent: BusClient) -> None:
    job, other = f"rd-{uuid.uuid4().hex[:6]}", f"rd-{uuid.uuid4().hex[:6]}"
    since = datetime.now(UTC) - timedelta(seconds=5)
    await _batches(agent, other, 2)
    await _batches(agent, job, 4)
    reader = await TelemetryReader.open(ctx.js, "test-read", Subjects.job_iterations(job),
                                        start_time=since)
    try:
        got = await _read_all(reader)
        assert [b.iteration for _, b in got] == [[0], [1], [2], [3]]  # not the other job's
        third_seq = got[2][0]
    finally:
        await reader.close()
    with pytest.raises(nats.js.errors.NotFoundError):
        await ctx.js.consumer_info(TELEMETRY, reader.name)
    later = await TelemetryReader.open(ctx.js, "test-read", Subjects.job_iterations(job),
                                       start_seq=third_seq)
    try:
        assert [b.iteration for _, b in await _read_all(later)] == [[2], [3]]
    finally:
        await later.close()
    with pytest.raises(ValueError, match="one of them"):
        await TelemetryReader.open(ctx.js, "test-read", "x", start_time=since, start_seq=1)


async def test_the_iteration_watch_reads_through_it(ctx: ServiceContext,
                                                   agent: BusClient) -> None:
    job = f"rd-{uuid.uuid4().hex[:6]}"
    since = datetime.now(UTC) - timedelta(seconds=5)
    await _batches(agent, job, 3)
    seen: list[float] = []
    done = asyncio.Event()

    async def on_times(j: str, times: list[float]) -> None:
        assert j == job
        seen.extend(times)
        if len(seen) >= 3:
            done.set()

    watch = IterationWatch(ctx.js, job, since, on_times)
    task = asyncio.create_task(watch.run())
    try:
        await asyncio.wait_for(done.wait(), 30)
    finally:
        watch.stop()
        await asyncio.wait_for(task, 30)
    assert seen[:3] == pytest.approx([0.1, 0.11, 0.12])
    names = [c.name for c in await ctx.js.consumers_info(TELEMETRY)]
    assert not any(n.startswith("planner-iter-") for n in names), names
