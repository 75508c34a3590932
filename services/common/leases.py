"""Partition ownership: exactly one live owner per (service, partition), by Postgres session
advisory locks.

A process that owns a partition holds ``pg_try_advisory_lock(namespace(service), partition)``
on a connection of its own (``Leases``), opened for that purpose and kept for the owner's life:

* **Exclusion.** The server grants a session advisory lock to one session at a time, so a second
  process cannot take the partition while the first one's connection lives. (Within one session
  the lock is re-entrant, so ``Leases`` itself refuses to take a key twice.)
* **A dead owner hands over at once.** A killed process's socket is closed by its kernel, the
  server ends the session and the lock is free: a standby asking every ``retry_s`` has it within
  about that, with no expiry to wait out.
* **A lost owner is bounded in time.** An owner cut off from Postgres (a network partition, a
  frozen host) cannot close its session. The server ends a session silent for
  ``server_release_s`` (``idle_session_timeout``; TCP keepalives and ``tcp_user_timeout`` for a
  peer that vanished mid-send), freeing the lock; the owner confirms its locks every
  ``heartbeat_s`` (reading ``pg_locks`` for its own backend) and gives a partition up as soon as
  its last confirmation is older than ``valid_for_s`` < ``server_release_s``, so it has stopped
  consuming before anyone else can take over. The loss is surfaced (``Lease.lost``,
  ``Lease.watch()`` raising LeaseLost) and the owner stops consuming that partition at once.

Why not a JetStream key-value bucket with revisions (create-if-absent, update at a revision,
the bucket's max age as the expiry)? It would work, with the bus as the only dependency, but a
killed owner's key outlives it until the expiry, so every takeover waits a full TTL (renewals
at a third of it, a write per owner and renewal through the stream's raft on a cluster), and the
bucket is one more stream for every deployment to declare. Postgres is already where each
stateful service commits its work, it frees a dead session's locks the moment the session
ends, and its timeouts bound the partitioned case. The cost: the lease connection must reach
Postgres itself (a session-pooling proxy at most: a transaction-pooling PgBouncer would hand
the lock's session to others), and an owner that loses Postgres stops consuming, which it does
anyway for want of its database. A failover to a standby Postgres drops every session, and with
them every lease: owners give up, then take their partitions again on the new primary.

Keys are namespaced: ``(namespace(service), partition)`` is the two-int4 form of the lock,
apart from the single-bigint form the migrations take (services.common.db.migrate), and
advisory locks are per database, so two stacks on one server never share a lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import socket
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import asyncpg

from services.common.bus.errors import describe
from services.common.redact import redact

log = logging.getLogger(__name__)

_HELD = ("SELECT classid::int8, objid::int8 FROM pg_locks WHERE locktype = 'advisory' "
         "AND pid = pg_backend_pid() AND objsubid = 2 AND granted")
_OWNERS = ("SELECT l.objid::int8, a.application_name FROM pg_locks l JOIN pg_stat_activity a "
           "USING (pid) WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted "
           "AND l.classid::int8 = $1")
APP_PREFIX = "greyhound-lease "


# ---- the pure part: keys, timing, choices --------------------------------------------------

def namespace(service: str) -> int:
    """The lock's first key for ``service``: stable across processes and versions, in
    [0, 2**31) so that the int4 the lock takes and the oid pg_locks shows are the same number."""
    digest = hashlib.sha256(f"greyhound.lease.{service}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFF_FFFF


@dataclass(frozen=True)
class LeaseKey:
    """One partition of one service's work."""

    service: str
    partition: int

    def __post_init__(self) -> None:
        if not self.service or not 0 <= self.partition < 2**31:
            raise ValueError(f"bad lease key {self}")

    @property
    def lock(self) -> tuple[int, int]:
        return namespace(self.service), self.partition

    def __str__(self) -> str:
        return f"{self.service}/{self.partition}"


@dataclass(frozen=True)
class LeaseTiming:
    """How a lease is kept: confirmed every ``heartbeat_s``, given up by its owner once the last
    confirmation is ``valid_for_s`` old, freed by the server after ``server_release_s`` of
    silence from an owner it lost, asked for by a standby every ``retry_s``."""

    heartbeat_s: float = 1.0
    valid_for_s: float = 3.0
    server_release_s: float = 6.0
    retry_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s < self.valid_for_s:
            raise ValueError("a lease is confirmed more often than it stays valid")
        if self.server_release_s < self.valid_for_s + 1.0:
            raise ValueError("the server frees a silent owner's lease at least a second after "
                             "that owner gave it up")
        if self.retry_s <= 0:
            raise ValueError("retry_s must be > 0")

    @classmethod
    def for_validity(cls, valid_for_s: float, retry_s: float) -> LeaseTiming:
        """Confirmed three times per validity, released by the server after twice it."""
        return cls(heartbeat_s=valid_for_s / 3, valid_for_s=valid_for_s,
                   server_release_s=2 * valid_for_s, retry_s=retry_s)

    def server_settings(self) -> dict[str, str]:
        """The lease connection's session settings: the server ends the session (freeing the
        locks) once the owner has been silent ``server_release_s``; a statement never outlives
        the owner's validity."""
        release_ms = int(self.server_release_s * 1000)
        idle = max(1, int(self.heartbeat_s))
        count = max(1, int((self.server_release_s - idle) // idle))
        return {"idle_session_timeout": str(release_ms),
                "tcp_keepalives_idle": str(idle), "tcp_keepalives_interval": str(idle),
                "tcp_keepalives_count": str(count), "tcp_user_timeout": str(release_ms),
                "statement_timeout": str(int(self.valid_for_s * 1000)),
                "application_name": application_name()}


def application_name() -> str:
    """The lease connection's name in pg_stat_activity: which host and process owns what
    (``pg_locks`` joined on ``pid``)."""
    return f"{APP_PREFIX}{os.getpid()}@{socket.gethostname()}"[:63]  # Postgres keeps 63 bytes


def owner_pid(name: str) -> int | None:
    """The process id in a lease connection's application name (None: not one)."""
    if not name.startswith(APP_PREFIX):
        return None
    pid = name[len(APP_PREFIX):].partition("@")[0]
    return int(pid) if pid.isdigit() else None


def in_turn(partitions: int, given: int | None) -> list[int]:
    """The partitions a process asks for, in order: the one it was given, or every one,
    lowest first (the first free is taken)."""
    if given is not None:
        if not 0 <= given < partitions:
            raise ValueError(f"partition {given} is not one of {partitions}")
        return [given]
    return list(range(partitions))


def still_held(held: Iterable[LeaseKey], locked: Iterable[tuple[int, int]]) -> set[LeaseKey]:
    """Of the keys a process believes it holds, those its session really still locks."""
    have = set(locked)
    return {k for k in held if k.lock in have}


# ---- the I/O: one connection per process ----------------------------------------------------

class LeaseLost(RuntimeError):
    """A lease this process held is no longer its own: stop the partition's work."""


@dataclass(eq=False)
class Lease:
    """A partition held by this process until ``lost`` is set (or it is released)."""

    key: LeaseKey
    valid_for_s: float
    confirmed_at: float = field(default_factory=time.monotonic)
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""

    @property
    def held(self) -> bool:
        return not self.lost.is_set() and not self.expired(time.monotonic())

    def expired(self, now: float) -> bool:
        return now - self.confirmed_at > self.valid_for_s

    def lose(self, reason: str, *, released: bool = False) -> None:
        if not self.lost.is_set():
            self.reason = reason
            self.lost.set()
            if released:
                log.info("lease %s given up", self.key)
            else:
                log.warning("lease %s lost: %s", self.key, reason)

    async def watch(self, until: asyncio.Event | None = None) -> None:
        """Raise LeaseLost when the lease is lost, or when it was not confirmed within its
        validity (the heartbeat itself held up); return once ``until`` is set while held."""
        while not self.lost.is_set():
            if until is not None and until.is_set():
                return
            left = self.confirmed_at + self.valid_for_s - time.monotonic()
            if left <= 0:
                self.lose(f"not confirmed for {self.valid_for_s:.1f}s")
                break
            waits = [asyncio.ensure_future(self.lost.wait())]
            if until is not None:
                waits.append(asyncio.ensure_future(until.wait()))
            try:
                await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        raise LeaseLost(f"lease {self.key}: {self.reason}")


async def owners(database_url: str, service: str) -> dict[int, str]:
    """Which connection holds each of ``service``'s partitions now: partition -> its
    application name (``greyhound-lease <pid>@<host>``), as Postgres sees it."""
    conn = await asyncpg.connect(dsn(database_url))
    try:
        rows = await conn.fetch(_OWNERS, namespace(service))
    finally:
        await conn.close()
    return {int(r[0]): str(r[1]) for r in rows}


def dsn(database_url: str) -> str:
    """asyncpg's form of a SQLAlchemy URL."""
    return database_url.replace("postgresql+asyncpg://", "postgresql://", 1)


class Leases:
    """This process's leases, on one dedicated Postgres connection (opened on demand, again
    after it was lost). Use as ``async with Leases(url) as leases`` and run ``heartbeat()`` as
    one of the process's tasks while it holds any."""

    def __init__(self, database_url: str, *, timing: LeaseTiming | None = None) -> None:
        self._dsn = dsn(database_url)
        self.timing = timing or LeaseTiming()
        self._conn: asyncpg.Connection | None = None
        self._io = asyncio.Lock()  # one statement at a time on the connection
        self._held: dict[LeaseKey, Lease] = {}

    async def __aenter__(self) -> Leases:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def held(self) -> list[Lease]:
        return list(self._held.values())

    async def _connection(self) -> asyncpg.Connection:
        if self._conn is None or self._conn.is_closed():
            conn: asyncpg.Connection = await asyncio.wait_for(asyncpg.connect(
                self._dsn, server_settings=self.timing.server_settings()),
                self.timing.valid_for_s * 2)
            conn.add_termination_listener(self._terminated)
            self._conn = conn
        return self._conn

    def _terminated(self, conn: object) -> None:
        if conn is self._conn:
            self._lose_all("the lease connection closed")

    def _lose_all(self, reason: str, *, released: bool = False) -> None:
        for lease in self._held.values():
            lease.lose(reason, released=released)
        self._held.clear()

    def _drop_connection(self, reason: str) -> None:
        """Close the connection without waiting for the server (it may be unreachable): its
        locks are freed when the server sees the socket close, or by its timeouts; every lease
        on it is lost."""
        self._lose_all(reason)
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            conn.terminate()

    async def try_acquire(self, key: LeaseKey) -> Lease | None:
        """The lease if no other session holds it; None if one does or Postgres cannot be
        asked now (logged)."""
        if key in self._held:
            raise ValueError(f"lease {key} is already held by this process")
        t0 = time.monotonic()
        try:
            async with self._io:
                conn = await self._connection()
                got = await asyncio.wait_for(
                    conn.fetchval("SELECT pg_try_advisory_lock($1, $2)", *key.lock),
                    self.timing.valid_for_s)
        except Exception as exc:
            log.warning("could not ask Postgres for lease %s at %s: %s", key,
                        redact(self._dsn), describe(exc))
            self._drop_connection(f"the lease connection failed: {describe(exc)}")
            return None
        if not got:
            return None
        lease = Lease(key, self.timing.valid_for_s, confirmed_at=t0)
        self._held[key] = lease
        log.info("lease %s taken", key)
        return lease

    async def acquire_first(self, keys: Sequence[LeaseKey], stop: asyncio.Event) -> Lease | None:
        """The first of ``keys`` that is free, asking again every ``retry_s`` until one is;
        None once ``stop`` is set."""
        waiting_logged = False
        while not stop.is_set():
            for key in keys:
                if key not in self._held:
                    lease = await self.try_acquire(key)
                    if lease is not None:
                        return lease
            if not waiting_logged:
                log.info("standing by: %s held by others; asking again every %.1fs",
                         ", ".join(map(str, keys)), self.timing.retry_s)
                waiting_logged = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.timing.retry_s)
        return None

    async def release(self, lease: Lease) -> None:
        """Give the lease up (its work stopped and saved first), or one found lost whose lock
        this session may still have (its confirmation late, the connection alive)."""
        if self._held.pop(lease.key, None) is None:
            return
        lease.lose("released", released=True)
        try:
            async with self._io:
                if self._conn is not None and not self._conn.is_closed():
                    await asyncio.wait_for(self._conn.fetchval(
                        "SELECT pg_advisory_unlock($1, $2)", *lease.key.lock),
                        self.timing.valid_for_s)
        except Exception as exc:  # the server frees it with the session
            log.warning("could not release lease %s: %s", lease.key, describe(exc))
            self._drop_connection(f"the lease connection failed: {describe(exc)}")

    async def confirm(self) -> None:
        """One heartbeat: the locks this session still has; a lease it lacks, or a failure to
        ask, is lost (a failure drops the connection so the server frees what it still holds
        and nothing is held half-known)."""
        if not self._held:
            return
        t0 = time.monotonic()
        try:
            async with self._io:
                conn = self._conn
                if conn is None or conn.is_closed():
                    raise ConnectionError("the lease connection is closed")
                rows = await asyncio.wait_for(conn.fetch(_HELD), self.timing.heartbeat_s * 2)
        except Exception as exc:
            self._drop_connection(f"could not confirm it: {describe(exc)}")
            return
        ok = still_held(self._held, ((int(r[0]), int(r[1])) for r in rows))
        for key in list(self._held):
            if key in ok:
                self._held[key].confirmed_at = t0
            else:
                self._held.pop(key).lose("its lock is no longer this session's")

    async def heartbeat(self, stop: asyncio.Event | None = None) -> None:
        """Confirm the held leases every ``heartbeat_s`` until ``stop`` (for ever without)."""
        never = asyncio.Event()
        until = stop or never
        while not until.is_set():
            await self.confirm()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(until.wait(), self.timing.heartbeat_s)

    async def close(self) -> None:
        """Release everything: the session ends, and its locks with it."""
        self._lose_all("released", released=True)
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            try:
                await asyncio.wait_for(conn.close(), self.timing.heartbeat_s * 2)
            except Exception:
                conn.terminate()
