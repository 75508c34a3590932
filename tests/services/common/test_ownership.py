"""Partitions of the jobs (services.common.ownership): the job hash is the one NATS's subject
transform computes (checked against a real server storing telemetry by partition), the durables
of a partition are named and granted from the one shared count, and the ownership loop serves
a partition only while its lease is held, forgetting it unsaved when the lease is lost."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Callable

import asyncpg
import pytest

from services.common.bus.auth import agent_user
from services.common.bus.client import ensure_streams
from services.common.bus.contract import Subjects
from services.common.bus.grants import GRANTS
from services.common.bus.permissions import all_durables
from services.common.bus.streams import (
    ANALYZER,
    ANALYZER_COLLECTIVES,
    EVENTS,
    PLANNER,
    TELEMETRY,
    collectives_spec,
    partitioned,
)
from services.common.leases import LeaseTiming, dsn, namespace, owners
from services.common.ownership import Ownership, Partition, own_partitions, partition_of
from services.common.settings import Settings
from tests.conftest import new_bus


def test_every_job_is_in_exactly_one_partition_and_the_hash_spreads_them() -> None:
    jobs = [f"job-{i}" for i in range(4000)]
    for n in (1, 2, 3, 8):
        parts = [Partition(i, n) for i in range(n)]
        for job in jobs[:200]:
            assert sum(p.owns(job) for p in parts) == 1
        sizes = Counter(partition_of(j, n) for j in jobs)
        assert set(sizes) == set(range(n))
        assert max(sizes.values()) < 1.2 * len(jobs) / n  # none takes much more than its share
    assert partition_of("job-7", 1) == 0 and Partition().owns("anything")
    with pytest.raises(ValueError):
        Partition(2, 2)


def test_a_partitioned_service_asks_for_its_given_partition_or_any() -> None:
    plan = Ownership.of("planner", 3, None, valid_s=3.0, retry_s=0.5)
    assert [k.partition for k in plan.lease_keys()] == [0, 1, 2]
    assert plan.timing.valid_for_s == 3.0 and plan.timing.retry_s == 0.5
    assert [k.partition for k in Ownership.of("planner", 3, 2, valid_s=3, retry_s=1).lease_keys()] == [2]
    with pytest.raises(ValueError):
        Ownership.of("planner", 2, 2, valid_s=3.0, retry_s=1.0)


def test_one_partition_keeps_the_durables_of_one_process() -> None:
    """The embedded mode is unchanged: with one partition every durable keeps its name."""
    assert partitioned(ANALYZER, 0, 1) == ANALYZER and partitioned(PLANNER, 0, 1) == PLANNER
    assert collectives_spec(0, 1) is ANALYZER_COLLECTIVES
    two = partitioned(PLANNER, 1, 2)
    assert two.durable == "planner-p1-of-2" and two.filter_subjects == PLANNER.filter_subjects
    feed = collectives_spec(1, 2)
    assert feed.durable == "analyzer-collectives-p1-of-2"
    assert feed.filter_subjects == (Subjects.in_partition(Subjects.ALL_COLLECTIVES, 1),)
    with pytest.raises(ValueError):
        partitioned(ANALYZER, 2, 2)


def test_every_partitions_durables_are_granted_to_its_service_and_denied_to_readers() -> None:
    durables = all_durables(2)
    for spec in (ANALYZER, PLANNER):
        assert {f"{spec.durable}-p0-of-2", f"{spec.durable}-p1-of-2"} <= set(durables[EVENTS])
        assert spec.durable not in durables[EVENTS]
    assert {"analyzer-collectives-p0-of-2", "analyzer-collectives-p1-of-2"} <= set(
        durables[TELEMETRY])
    assert all(c.partitioned for c in GRANTS["analyzer"].consume + GRANTS["planner"].consume)
    assert all_durables(1)[EVENTS].count("analyzer") == 1


def test_the_job_hash_is_the_servers_partition_transform() -> None:
    """Telemetry published for many jobs on a stream stored by 3 partitions: the partition
    token the server appended is ``partition_of`` of the job, for every one of them."""
    jobs = [f"j{uuid.uuid4().hex[:10]}" for _ in range(60)]

    async def scenario() -> dict[str, int]:
        op = await bus.connect()
        await ensure_streams(op.jetstream(), Settings(tracker_partitions=3))
        nc = await bus.connect(agent_user("a0"))
        js = nc.jetstream()
        try:
            for job in jobs:  # the server stores what it is given: the body does not matter
                await js.publish(Subjects.iterations(job, "a0"), b"{}")
        finally:
            await nc.close()
        try:
            stored = {}
            for job in jobs:
                msg = await op.jetstream().get_last_msg(
                    TELEMETRY, f"{Subjects.iterations(job, 'a0')}.*")
                stored[job] = int(str(msg.subject).rsplit(".", 1)[1])
            return stored
        finally:
            await op.close()

    with new_bus("gh-own-hash-", tracker_partitions=3) as bus:
        stored = asyncio.run(scenario())
    assert stored == {job: partition_of(job, 3) for job in jobs}
    assert set(stored.values()) == {0, 1, 2}


class _Owner:
    """A stand-in owner: what the loop asked of it, in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.serving = asyncio.Event()

    async def serve(self, part: Partition, stop: asyncio.Event) -> None:
        self.calls.append(f"serve {part.index}")
        self.serving.set()
        await stop.wait()

    async def forget(self) -> None:
        self.calls.append("forget")
        self.serving.clear()

    async def close(self) -> None:
        self.calls.append("close")


async def _until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, what
        await asyncio.sleep(0.05)


async def test_one_owner_serves_the_other_stands_by_and_a_lost_lease_is_forgotten(
        fresh_db_url: str) -> None:
    """Two processes' loops over one partition: one serves; its lease connection cut, it stops
    and forgets (never closes: saving would race the next owner) and the standby serves."""
    plan = Ownership("svc-test", 1, None, LeaseTiming.for_validity(1.5, 0.2))
    a, b = _Owner(), _Owner()
    stop = asyncio.Event()
    loops = [asyncio.create_task(own_partitions(o, plan, fresh_db_url, stop)) for o in (a, b)]
    try:
        await _until(lambda: a.serving.is_set() or b.serving.is_set(), 15.0, "nobody serves")
        first, other = (a, b) if a.serving.is_set() else (b, a)
        await asyncio.sleep(1.0)  # several retries of the standby's
        assert other.calls == [] and first.calls == ["serve 0"]
        assert set(await owners(fresh_db_url, "svc-test")) == {0}
        conn = await asyncpg.connect(dsn(fresh_db_url))
        try:  # cut the owner's lease connection, as a network partition would
            await conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' "
                "AND objsubid = 2 AND granted AND classid::int8 = $1", namespace("svc-test"))
        finally:
            await conn.close()
        await _until(lambda: "forget" in first.calls, 10.0, "the lost lease went unnoticed")
        await _until(lambda: other.serving.is_set() or first.calls.count("serve 0") == 2, 10.0,
                     "nobody took the partition over")
        assert first.calls[:2] == ["serve 0", "forget"]  # not closed: nothing saved
    finally:
        stop.set()
        await asyncio.gather(*loops)
    # whoever serves at the end closes it in good order on stop
    assert (a.calls + b.calls).count("close") == 1
