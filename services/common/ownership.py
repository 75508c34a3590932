"""A service's work split by job into partitions, each consumed by the one process that holds
its lease (services.common.leases): the tracker's, the analyzer's and the planner's.

A job belongs to partition ``partition_of(job, n)``: FNV-1a (32 bits) of the job id modulo n,
the hash NATS's ``partition(n, ...)`` subject transform computes. The three services share one
count, GREYHOUND_TRACKER_PARTITIONS: a job is in partition i of each of them (its telemetry
stored under i, so the analyzer's collectives durable of partition i is given that partition's
jobs by the server), and the bus's permissions, which name every durable, are generated from
that one number (docs/scaling.md says why one count and not one per service).

A process asks for one partition at a time: the one it was given, or the first free one,
asking again every ``retry_s`` while none is (a hot standby: a killed owner's lease frees with
its connection, so the standby has it within about that). Holding it, it serves it
(``Owner.serve``) until asked to stop, then closes it (saving what it keeps); a lost lease
(its connection dropped, or not confirmed in time) stops the serving at once and the owner
forgets the partition's jobs unsaved (the next owner may be saving them already), then asks for
a partition again after twice ``retry_s``, so that a standby takes it over first. Without a
database (a benchmark, a test) there are no leases: the partition given, or 0, is served.

What a service keeps in memory about a job must therefore be restorable by any process from
what the last owner saved, and what it does on its own (a periodic round, resuming unfinished
work) must touch only the jobs its partition ``owns``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Protocol

from pydantic import Field

from services.common.leases import Lease, LeaseKey, LeaseLost, Leases, LeaseTiming, in_turn
from services.common.runtime import supervise

log = logging.getLogger(__name__)

_FNV_OFFSET = 0x811C9DC5
_FNV_PRIME = 0x01000193

# The partition settings of the analyzer and the planner, the same knobs in each one's settings
# (composed, not inherited): GREYHOUND_<SERVICE>_PARTITION and so on. The count is shared:
# GREYHOUND_TRACKER_PARTITIONS (services.common.settings), see the module docstring.
GivenPartition = Annotated[int | None, Field(ge=0, description=(
    "the one partition this process waits for (unset: the first free one)"))]
LeaseValidS = Annotated[float, Field(ge=1.0, le=60, description=(
    "a partition's owner stops consuming once its lease was not confirmed for this long; "
    "Postgres frees the lease of an owner silent for twice this"))]
LeaseRetryS = Annotated[float, Field(gt=0, le=60, description=(
    "how often a process without a partition asks for a free one (a killed owner's "
    "partition is taken over within about this)"))]


def partition_of(job: str, partitions: int) -> int:
    """The job's partition of ``partitions``: as NATS's ``partition(n, 1)`` transform computes
    it over the job token (FNV-1a, 32 bits, modulo n)."""
    if partitions <= 1:
        return 0
    h = _FNV_OFFSET
    for byte in job.encode():
        h = ((h ^ byte) * _FNV_PRIME) & 0xFFFF_FFFF
    return h % partitions


@dataclass(frozen=True)
class Partition:
    """Partition ``index`` of ``count``: the jobs one process consumes."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"partition {self.index} is not one of {self.count}")

    def owns(self, job: str) -> bool:
        return self.count <= 1 or partition_of(job, self.count) == self.index

    @property
    def jobs(self) -> Callable[[str], bool] | None:
        """What a query for this partition's rows filters its jobs by (a repository applies
        it before its limit and its locks); None when this process has every job."""
        return None if self.count <= 1 else self.owns

    def __str__(self) -> str:
        return f"{self.index} of {self.count}"


@dataclass(frozen=True)
class Ownership:
    """How a service's processes share its partitions: ``count`` of them, this process
    waiting for ``given`` alone or for the first free one, its leases kept by ``timing``."""

    service: str
    count: int = 1
    given: int | None = None
    timing: LeaseTiming = field(default_factory=LeaseTiming)

    @classmethod
    def of(cls, service: str, count: int, given: int | None, *, valid_s: float,
           retry_s: float) -> Ownership:
        in_turn(count, given)  # fail fast on a partition that is not one of them
        return cls(service, count, given, LeaseTiming.for_validity(valid_s, retry_s))

    def lease_keys(self) -> list[LeaseKey]:
        """The partitions this process asks for, in order."""
        return [LeaseKey(self.service, i) for i in in_turn(self.count, self.given)]


class Owner(Protocol):
    """What a service gives the ownership loop."""

    async def serve(self, part: Partition, stop: asyncio.Event) -> None:
        """Consume the partition's jobs (resuming what its last owner left) until ``stop``."""

    async def forget(self) -> None:
        """The lease was lost: drop the partition's jobs from memory, unsaved."""

    async def close(self) -> None:
        """The partition is given up in good order: save what the next owner needs."""


async def hold(owner: Owner, part: Partition, stop: asyncio.Event, *, lease: Lease | None = None,
               leases: Leases | None = None) -> None:
    """Serve ``part`` until ``stop`` (then close it), or until ``lease`` is lost (LeaseLost;
    the owner forgets the partition's jobs)."""
    tasks = [owner.serve(part, stop)]
    if lease is not None and leases is not None:
        tasks += [lease.watch(until=stop), leases.heartbeat(stop)]
    try:
        await supervise(*tasks)
    except LeaseLost:
        await owner.forget()
        raise
    finally:
        if lease is None or lease.held:
            await owner.close()


async def own_partitions(owner: Owner, plan: Ownership, database_url: str | None,
                         stop: asyncio.Event) -> None:
    """Hold a partition's lease and serve it, again after a loss, until ``stop``."""
    if database_url is None:
        await hold(owner, Partition(plan.given or 0, plan.count), stop)
        return
    keys = plan.lease_keys()
    async with Leases(database_url, timing=plan.timing) as leases:
        while not stop.is_set():
            lease = await leases.acquire_first(keys, stop)
            if lease is None:
                return
            part = Partition(lease.key.partition, plan.count)
            log.info("%s owns partition %s", plan.service, part)
            try:
                await hold(owner, part, stop, lease=lease, leases=leases)
            except LeaseLost as exc:
                log.warning("%s stopped consuming partition %s: %s; asking for a partition "
                            "again", plan.service, part, exc)
                # what this session may still lock (a confirmation late, not refused) is freed
                await leases.release(lease)
                # a standby (asking every retry_s) takes it first: a process whose database
                # link failed does not win its partition straight back
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 2 * plan.timing.retry_s)
                continue
            await leases.release(lease)
