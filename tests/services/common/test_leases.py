"""Partition leases on a real Postgres: one owner at a time, a killed owner's lease taken over
at once, a lost connection surfaced to its owner, and an owner cut off from Postgres giving up
before anyone else can take over."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from services.common.leases import (
    LeaseKey,
    LeaseLost,
    Leases,
    LeaseTiming,
    application_name,
    dsn,
    in_turn,
    namespace,
    owner_pid,
    still_held,
)
from tests.services.common.pg_proxy import PgProxy

ROOT = Path(__file__).resolve().parents[3]
FAST = LeaseTiming(heartbeat_s=0.3, valid_for_s=1.0, server_release_s=2.5, retry_s=0.2)
# A loaded 2-core machine: a process start, a kill and a poll within this.
TAKEOVER_BOUND_S = 10.0
KEY = LeaseKey("tracker", 1)


def test_keys_are_namespaced_and_stable() -> None:
    assert namespace("tracker") == namespace("tracker")
    assert namespace("tracker") != namespace("analyzer")
    assert 0 <= namespace("planner") < 2**31
    assert LeaseKey("tracker", 3).lock == (namespace("tracker"), 3)
    assert in_turn(4, None) == [0, 1, 2, 3] and in_turn(4, 2) == [2]
    with pytest.raises(ValueError):
        in_turn(2, 2)
    with pytest.raises(ValueError):
        LeaseTiming(heartbeat_s=1, valid_for_s=3, server_release_s=3.5)
    a, b = LeaseKey("tracker", 0), LeaseKey("tracker", 1)
    assert still_held({a, b}, [a.lock, (namespace("analyzer"), 1)]) == {a}
    assert owner_pid(application_name()) == os.getpid()
    assert owner_pid("psql") is None
    assert LeaseTiming.for_validity(1.0, 1.0).server_release_s == 2.0


@contextlib.asynccontextmanager
async def _leases(url: str, timing: LeaseTiming = FAST) -> AsyncIterator[Leases]:
    async with Leases(url, timing=timing) as leases:
        beat = asyncio.create_task(leases.heartbeat())
        try:
            yield leases
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat


async def test_two_owners_cannot_hold_one_lease(fresh_db_url: str) -> None:
    async with _leases(fresh_db_url) as a, _leases(fresh_db_url) as b:
        held = await a.try_acquire(KEY)
        assert held is not None
        assert await b.try_acquire(KEY) is None  # another session: refused
        with pytest.raises(ValueError):
            await a.try_acquire(KEY)  # the lock is re-entrant in a session; Leases is not
        other = await b.try_acquire(LeaseKey("analyzer", 1))  # another service's partition 1
        assert other is not None
        await asyncio.sleep(FAST.valid_for_s * 2)  # heartbeats keep it
        assert held.held and await b.try_acquire(KEY) is None
        await a.release(held)
        assert not held.held
        taken = await b.try_acquire(KEY)
        assert taken is not None and taken.held


async def test_first_free_partition_is_taken(fresh_db_url: str) -> None:
    keys = [LeaseKey("tracker", i) for i in range(3)]
    async with _leases(fresh_db_url) as a, _leases(fresh_db_url) as b:
        stop = asyncio.Event()
        first = await a.acquire_first(keys, stop)
        second = await b.acquire_first(keys, stop)
        assert first is not None and second is not None
        assert (first.key.partition, second.key.partition) == (0, 1)


OWNER = """
import asyncio, sys
from services.common.leases import LeaseKey, Leases
async def main():
    leases = Leases(sys.argv[1])
    lease = await leases.try_acquire(LeaseKey("tracker", 1))
    print("held" if lease else "refused", flush=True)
    await leases.heartbeat()
asyncio.run(main())
"""


async def test_a_killed_owners_lease_is_taken_over_within_the_bound(fresh_db_url: str) -> None:
    proc = subprocess.Popen([sys.executable, "-c", OWNER, fresh_db_url], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 20)
        assert line.strip() == "held"
        async with _leases(fresh_db_url) as standby:
            assert await standby.try_acquire(KEY) is None
            os.kill(proc.pid, signal.SIGKILL)
            t0 = time.monotonic()
            lease = await asyncio.wait_for(standby.acquire_first([KEY], asyncio.Event()),
                                           TAKEOVER_BOUND_S)
            took = time.monotonic() - t0
            assert lease is not None and lease.held
            assert took < FAST.retry_s + 2.0, took  # freed with the session, not by a timeout
    finally:
        proc.kill()
        proc.wait()


async def test_a_dropped_connection_is_surfaced_to_the_owner(fresh_db_url: str) -> None:
    async with _leases(fresh_db_url) as owner:
        lease = await owner.try_acquire(KEY)
        assert lease is not None
        admin = await asyncpg.connect(dsn(fresh_db_url))
        try:
            await admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                "WHERE application_name LIKE 'greyhound-lease %'")
        finally:
            await admin.close()
        t0 = time.monotonic()
        with pytest.raises(LeaseLost):
            await asyncio.wait_for(lease.watch(), 5.0)
        assert time.monotonic() - t0 < FAST.valid_for_s + 1.0
        assert not lease.held and owner.held == []
        again = await owner.try_acquire(KEY)  # a new connection, the lock free again
        assert again is not None


async def test_a_lease_not_confirmed_in_time_is_lost_and_freed_on_release(fresh_db_url: str
                                                                          ) -> None:
    """No heartbeat (the owner's loop held up): its owner must stop at the validity, and the
    lock its live session still has is freed by the release that follows."""
    async with Leases(fresh_db_url, timing=FAST) as owner, _leases(fresh_db_url) as other:
        lease = await owner.try_acquire(KEY)
        assert lease is not None
        with pytest.raises(LeaseLost):
            await asyncio.wait_for(lease.watch(), FAST.valid_for_s + 2.0)
        assert await other.try_acquire(KEY) is None  # still locked: stopped, not yet freed
        await owner.release(lease)
        assert await other.try_acquire(KEY) is not None


class FreezingProxy(PgProxy):
    """The proxy, able to stop carrying bytes while keeping every connection open: a network
    partition, where neither side sees the other close."""

    def __init__(self, db_url: str) -> None:
        super().__init__(db_url)
        self.flowing = asyncio.Event()
        self.flowing.set()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                await self.flowing.wait()
                writer.write(data)
                await writer.drain()


async def test_an_owner_cut_off_gives_up_before_anyone_takes_over(fresh_db_url: str) -> None:
    proxy = FreezingProxy(fresh_db_url)
    await proxy.start()
    try:
        async with _leases(proxy.url) as owner, _leases(fresh_db_url) as standby:
            lease = await owner.try_acquire(KEY)
            assert lease is not None
            watched = asyncio.create_task(lease.watch())
            proxy.flowing.clear()  # the owner's packets go nowhere; its session stays open
            t0 = time.monotonic()
            taken = await asyncio.wait_for(standby.acquire_first([KEY], asyncio.Event()),
                                           TAKEOVER_BOUND_S)
            took = time.monotonic() - t0
            assert taken is not None
            # the owner had stopped before the server freed its lock for the standby
            assert watched.done() and isinstance(watched.exception(), LeaseLost)
            assert took >= FAST.valid_for_s, took
            assert took < FAST.server_release_s + 3.0, took
    finally:
        proxy.flowing.set()
        await proxy.stop()
