"""The tracker's hang watch over a real nats-server: counters of an asynchronous job, where every
host has left NCCL and the collective sits pending on the GPUs, raise a hang event that says its
wait was read on the GPU and carries the GPU columns the analyzer diagnoses from."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.common.bus.contract import CounterBatch, DetectionEvent, ProgressRows, Subjects
from services.common.bus.streams import EVENTS
from services.common.db.documents import Evidence
from services.common.runtime import ServiceContext, start_service
from services.common.settings import Settings
from services.tracker.service import Tracker
from services.tracker.settings import TrackerSettings
from tests.conftest import Bus

HANG_FLOOR = TrackerSettings(hang_floor_s=2.0)


@pytest.fixture()
async def ctx(bus: Bus) -> AsyncIterator[ServiceContext]:
    """The tracker's connection (no consumer: the tests hand it messages)."""
    settings = Settings(nats_url=bus.url)
    c = await start_service("tracker", settings, need_db=False, backends=bus.backends("tracker"))
    yield c
    await c.close()


def _counters(job: str, pending_s: float, *, marks: int = 1) -> CounterBatch:
    n = 4
    cols: dict[str, list[Any]] = {c: [0] * n for c in CounterBatch.COLUMNS}
    cols.update(rank=list(range(n)), comm_id=[(1 << 64) - 7] * n, comm_rank=list(range(n)),
                nranks=[n] * n, entered=[12, 12, 9, 12], completed=[12, 12, 9, 12],
                last_seq_entered=[12, 12, 9, 12], last_seq_completed=[12, 12, 9, 12],
                inflight_s=[0.0] * n, last_op=[1] * n, gpu_marks=[marks] * n,
                gpu_completed=[9] * n, gpu_seq_completed=[9] * n,
                gpu_pending_s=[pending_s, pending_s, 0.0, pending_s],
                gpu_pending_seq=[10, 10, 0, 10], gpu_pending_op=[1, 1, 0, 1])
    return CounterBatch(job_id=job, agent_id="a0", sampled_ns=time.time_ns(), **cols)


async def _events(bus: Bus, job: str) -> list[DetectionEvent]:
    """What the tracker published for ``job``, read by the operator."""
    nc = await bus.connect()
    sub = await nc.jetstream().pull_subscribe(Subjects.detection(job), stream=EVENTS)
    out: list[DetectionEvent] = []
    try:
        while True:
            out += [DetectionEvent.model_validate_json(m.data)
                    for m in await sub.fetch(10, timeout=0.5)]
    except TimeoutError:
        pass
    await sub.unsubscribe()
    await nc.close()
    return out


async def test_collective_pending_on_the_gpu_is_a_hang_with_no_host_inside_nccl(
        ctx: ServiceContext, bus: Bus) -> None:
    job = f"gpuhang-{uuid.uuid4().hex[:6]}"
    tracker = Tracker(ctx, settings=HANG_FLOOR)
    await tracker.handle(Subjects.counters(job, "a0"), _counters(job, 0.5))
    assert await _events(bus, job) == []  # pending, but under the 2 s floor
    await tracker.handle(Subjects.counters(job, "a0"), _counters(job, 5.0))
    (event,) = await _events(bus, job)
    assert event.kind == "hang" and event.ranks == [0, 1, 3] and event.stalled_s == 5.0
    assert event.evidence["wait_basis"] == "gpu"
    rows = event.evidence["counters"]
    assert rows["gpu_pending_seq"] == [10, 10, 0, 10] and rows["inflight_s"] == [0.0] * 4


async def test_without_gpu_marks_only_host_time_counts(ctx: ServiceContext, bus: Bus) -> None:
    job = f"hosthang-{uuid.uuid4().hex[:6]}"
    tracker = Tracker(ctx, settings=HANG_FLOOR)
    await tracker.handle(Subjects.counters(job, "a0"), _counters(job, 5.0, marks=0))
    assert await _events(bus, job) == []  # the GPU columns are not read; no host is inside


async def test_the_hang_is_over_when_the_communicator_moves_again(ctx: ServiceContext, bus: Bus) -> None:
    """The job's hang incident needs an end: once every stalled communicator completes calls
    again, the tracker says so (a recovery from the hang watch), once."""
    job = f"hangover-{uuid.uuid4().hex[:6]}"
    tracker = Tracker(ctx, settings=HANG_FLOOR)
    await tracker.handle(Subjects.counters(job, "a0"), _counters(job, 0.5))
    await tracker.handle(Subjects.counters(job, "a0"), _counters(job, 5.0))
    moved = _counters(job, 0.0).model_copy(update={"gpu_completed": [12] * 4,
                                                  "gpu_seq_completed": [12] * 4})
    await tracker.handle(Subjects.counters(job, "a0"), moved)
    await tracker.handle(Subjects.counters(job, "a0"), moved)  # nothing more to say
    hang, over = await _events(bus, job)
    assert hang.kind == "hang" and hang.before_s > 0  # a level the contract accepts
    assert over.kind == "recovery" and over.hang_over and over.comm_id == hang.comm_id
    assert over.evidence["moved_comms"] == [hang.comm_id]


async def test_a_hang_event_carries_the_plugins_rows_of_the_stalled_communicator(
        ctx: ServiceContext, bus: Bus) -> None:
    """Where inside the collective the ranks stopped goes with the hang to the analyzer; a batch
    from an older agent (no peer columns, no plugin rows) is watched as before."""
    job = f"insidehang-{uuid.uuid4().hex[:6]}"
    tracker = Tracker(ctx, settings=HANG_FLOOR)
    old = _counters(job, 0.5).model_copy(update={"last_peer": [], "gpu_pending_peer": []})
    await tracker.handle(Subjects.counters(job, "a0"), old)
    cols: dict[str, list[Any]] = {c: [0] * 2 for c in ProgressRows.COLUMNS}
    cols.update(rank=[1, 2], comm_id=[(1 << 64) - 7] * 2, comm_rank=[1, 2], kind=[0, 1],
                channel=[1, 1], peer=[2, 1], posted=[24, 24], done=[12, 12], stalled_s=[4.0, 4.0])
    stuck = _counters(job, 5.0).model_copy(update={"progress": ProgressRows.model_validate(cols)})
    await tracker.handle(Subjects.counters(job, "a0"), stuck)
    (event,) = await _events(bus, job)
    prog = event.evidence["progress"]
    assert prog["rank"] == [1, 2] and prog["done"] == [12, 12] and prog["channel"] == [1, 1]
    assert event.evidence["counters"]["gpu_pending_peer"] == [0] * 4
    # the analyzer keeps the tracker's view as the incident's evidence: every key a typed field
    stored = Evidence.model_validate(event.evidence)
    assert stored.progress is not None and stored.progress["done"] == [12, 12]
    assert stored.stalled_comms == [(1 << 64) - 7] and stored.wait_basis == "gpu"
