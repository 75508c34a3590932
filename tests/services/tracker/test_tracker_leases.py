"""Tracker processes (``greyhound tracker``, as deployed) on a real NATS and Postgres: one
process per partition at a time, a standby taking over a partition whose owner stopped or was
killed, and the killed owner's jobs continued from their saved state with every detection made
once."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from services.common.bus.auth import agent_user
from services.common.bus.contract import Subjects
from services.common.bus.streams import TELEMETRY
from services.common.leases import dsn, owner_pid, owners
from services.common.runtime import start_service
from services.common.settings import Settings
from services.tracker.ownership import LEASE_SERVICE, own_partitions
from services.tracker.service import Tracker
from services.tracker.settings import TrackerSettings
from services.tracker.state_store import TrackerStateStore
from stack.up import end_processes
from tests.conftest import Bus, new_bus
from tests.services.tracker.test_tracker_service import (
    _detections,
    _one_slowdown,
    _send_js,
    _series,
)

ROOT = Path(__file__).resolve().parents[3]
# Generous on a loaded 2-core machine: three interpreters starting at once, migrations run.
STARTED_WITHIN_S = 25.0
TAKEOVER_WITHIN_S = 10.0  # the target: a dead owner's partition consumed again within this


class Trackers:
    """``greyhound tracker`` processes on one bus and database, each logging to its file."""

    def __init__(self, bus: Bus, db_url: str, tmp: Path, partitions: int) -> None:
        creds = bus.creds("tracker")
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "GREYHOUND_NATS_URL": bus.url,
                    "GREYHOUND_NATS_USER": creds.user, "GREYHOUND_NATS_PASSWORD": creds.password,
                    "GREYHOUND_DATABASE_URL": db_url, "GREYHOUND_DATA_DIR": str(tmp),
                    "GREYHOUND_TRACKER_PARTITIONS": str(partitions),
                    "GREYHOUND_TRACKER_PERSIST_EVERY_S": "0.5", "GREYHOUND_LOG_LEVEL": "INFO"}
        self.env.pop("GREYHOUND_TRACKER_PARTITION", None)
        self.db = dsn(db_url)
        self.db_url = db_url
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> subprocess.Popen[bytes]:
        with (self.tmp / f"tracker-{len(self.procs)}.log").open("ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "stack.cli", "tracker"], cwd=ROOT,
                                    env=self.env, stdout=out, stderr=out,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def log(self, proc: subprocess.Popen[bytes]) -> str:
        return (self.tmp / f"tracker-{self.procs.index(proc)}.log").read_text()

    async def owners(self) -> dict[int, int]:
        """Partition -> the pid of the process holding its lease."""
        return {p: owner_pid(name) or 0
                for p, name in (await owners(self.db_url, LEASE_SERVICE)).items()}

    async def until_owned(self, partitions: set[int], timeout_s: float,
                          but: int | None = None) -> dict[int, int]:
        end = time.monotonic() + timeout_s
        while True:
            owners = await self.owners()
            if set(owners) >= partitions and but not in owners.values():
                return owners
            assert time.monotonic() < end, f"owners {owners}, wanted {partitions}"
            await asyncio.sleep(0.1)

    def stop(self) -> None:
        end_processes(self.procs)


@contextlib.contextmanager
def trackers(bus: Bus, db_url: str, tmp: Path, partitions: int, n: int) -> Iterator[Trackers]:
    t = Trackers(bus, db_url, tmp, partitions)
    try:
        for _ in range(n):
            t.start()
        yield t
    finally:
        t.stop()


@contextlib.asynccontextmanager
async def agent(bus: Bus) -> AsyncIterator[tuple[NATS, JetStreamContext]]:
    nc = await bus.connect(agent_user("a0"))
    try:
        yield nc, nc.jetstream()
    finally:
        await nc.close()


async def _consumed(bus: Bus, durable: str, timeout_s: float = 20.0) -> None:
    """The durable has nothing left to deliver and nothing delivered unacknowledged."""
    nc = await bus.connect()
    js = nc.jetstream()
    end = time.monotonic() + timeout_s
    try:
        while True:
            with contextlib.suppress(Exception):
                info = await js.consumer_info(TELEMETRY, durable)
                if not info.num_pending and not info.num_ack_pending:
                    return
            assert time.monotonic() < end, f"{durable} still has work"
            await asyncio.sleep(0.1)
    finally:
        await nc.close()


async def _partition_of(bus: Bus, job: str) -> int:
    """The partition the stream put the job's telemetry in (its stored subject's last token)."""
    nc = await bus.connect()
    try:
        msg = await nc.jetstream().get_last_msg(TELEMETRY, f"{Subjects.iterations(job, 'a0')}.*")
        return int(str(msg.subject).rsplit(".", 1)[1])
    finally:
        await nc.close()


def test_two_trackers_never_consume_one_partition(fresh_db_url: str, tmp_path: Path) -> None:
    """One partition, two processes: one consumes, the other stands by without binding the
    durable; stopped, the owner hands the partition to the standby, which goes on."""
    x = _series(40, slow_from=40, seed=5)

    async def scenario(bus: Bus) -> None:
        with trackers(bus, fresh_db_url, tmp_path, 1, 2) as t:
            owners = await t.until_owned({0}, STARTED_WITHIN_S)
            owner = next(p for p in t.procs if p.pid == owners[0])
            standby = next(p for p in t.procs if p is not owner)
            async with agent(bus) as (_, js):
                await _send_js(js, "one-part", x, 0, 20)
                await _consumed(bus, "tracker")
                assert await t.owners() == owners  # still one owner, the same
                assert "owns partition" not in t.log(standby)
                owner.send_signal(signal.SIGTERM)
                await t.until_owned({0}, TAKEOVER_WITHIN_S, but=owner.pid)
                assert owner.wait(15) == 0
                assert (await t.owners())[0] == standby.pid
                await _send_js(js, "one-part", x, 20, 40)
                await _consumed(bus, "tracker")
            assert "tracker owns partition 0 of 1" in t.log(standby)

    with new_bus("gh-trk-lease1-") as bus:
        asyncio.run(scenario(bus))


def test_standby_takes_over_a_killed_owner_and_continues_its_jobs(fresh_db_url: str,
                                                                   tmp_path: Path) -> None:
    """Two partitions, three processes: each partition has one owner, the third stands by. The
    owner of a slowing job's partition is killed (kill -9) between the slowdown's onset and its
    confirmation; the standby takes the partition within the bound, resumes the job from its
    saved state (and the stream) and reports the slowdown once: suspected, then confirmed."""
    job = "killed-owner"
    x = _series(200, slow_from=100, seed=102)

    async def scenario(bus: Bus) -> None:
        with trackers(bus, fresh_db_url, tmp_path, 2, 3) as t:
            owners = await t.until_owned({0, 1}, STARTED_WITHIN_S)
            assert len(set(owners.values())) == 2  # two processes, one partition each
            async with agent(bus) as (_, js):
                await _send_js(js, job, x, 0, 104)
                p = await _partition_of(bus, job)
                await _consumed(bus, f"tracker-p{p}-of-2")
                victim = next(q for q in t.procs if q.pid == owners[p])
                os.kill(victim.pid, signal.SIGKILL)
                t0 = time.monotonic()
                after = await t.until_owned({p}, TAKEOVER_WITHIN_S, but=victim.pid)
                took = time.monotonic() - t0
                assert after[p] not in owners.values() and after[1 - p] == owners[1 - p]
                await _send_js(js, job, x, 104, 200)
                await _consumed(bus, f"tracker-p{p}-of-2")
            assert took < TAKEOVER_WITHIN_S
            heir = next(q for q in t.procs if q.pid == after[p])
            assert f"job {job}: resumed detector state" in t.log(heir)
        slow = _one_slowdown(await _detections(bus, job))
        assert 100 <= slow.first_iteration <= 103

    with new_bus("gh-trk-lease2-", tracker_partitions=2) as bus:
        asyncio.run(scenario(bus))


def test_a_lost_lease_stops_the_partition_and_drops_its_jobs_unsaved(fresh_db_url: str,
                                                                     tmp_path: Path) -> None:
    """The lease connection cut under a running tracker: it stops consuming, forgets its jobs
    without saving them (the next owner may be saving them already) and takes the partition
    again once it is free."""
    x = _series(20, slow_from=20, seed=9)

    async def scenario(bus: Bus) -> None:
        settings = Settings(nats_url=bus.url, database_url=fresh_db_url, data_dir=tmp_path)
        ctx = await start_service("tracker", settings, backends=bus.backends("tracker",
                                                                              fresh_db_url))
        store = await TrackerStateStore(ctx.js).open()
        tracker = Tracker(ctx, store=store, settings=TrackerSettings(
            tracker_lease_valid_s=1.0, tracker_lease_retry_s=0.2, tracker_persist_every_s=60))
        stop = asyncio.Event()
        owning = asyncio.create_task(
            own_partitions(tracker, ctx, tracker.settings, stop))
        t = Trackers(bus, fresh_db_url, tmp_path, 1)
        try:
            await t.until_owned({0}, STARTED_WITHIN_S)
            async with agent(bus) as (_, js):
                await _send_js(js, "lost-lease", x, 0, 20)
                await _consumed(bus, "tracker")
            assert "lost-lease" in tracker.state
            conn = await asyncpg.connect(t.db)
            try:
                await conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                   "WHERE application_name LIKE 'greyhound-lease %'")
            finally:
                await conn.close()
            end = time.monotonic() + 5.0
            while "lost-lease" in tracker.state:
                assert time.monotonic() < end, "the jobs stayed after the lease was lost"
                await asyncio.sleep(0.05)
            await t.until_owned({0}, 10.0)  # taken again: nobody else wanted it
            assert await store.load("lost-lease") is None  # nothing saved after the loss
            assert not owning.done()
        finally:
            stop.set()
            await owning
            await ctx.close()

    with new_bus("gh-trk-lease3-") as bus:
        asyncio.run(scenario(bus))
