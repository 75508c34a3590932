"""Which partition of the jobs this tracker consumes: the one whose lease it holds.

With a database, a tracker process consumes a partition's durable only while it holds that
partition's lease (services.common.leases: a Postgres session advisory lock), so two processes
never consume one partition. GREYHOUND_TRACKER_PARTITION given: the process waits for that
partition alone (a standby for it while another process owns it). Not given: it takes the
first free partition of GREYHOUND_TRACKER_PARTITIONS and, while none is free, asks again every
``tracker_lease_retry_s``, so a standby takes a dead owner's partition over within about that
(a killed owner's lease frees with its connection). One partition per process: run N trackers
for N partitions, and a few more as standbys.

Taking a partition over needs nothing handed across: each job's state is loaded from the state
store (services.tracker.state_store) when its first message comes, and the batches between the
saved state and that message are read back from the stream (services.tracker.replay), so what
the dead owner observed but had not saved is observed once more and nothing twice.

A lost lease (its connection dropped, or not confirmed in time) stops the partition's consumer
at once and drops the jobs from memory unsaved: the next owner may already be saving them. The
process then asks for a partition again. On shutdown the jobs are saved, then the lease given up.

Without a database (a benchmark, a test) there are no leases: the partition configured is
consumed, as before.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from services.common.bus.client import Consumer
from services.common.bus.streams import ConsumerSpec, tracker_spec
from services.common.leases import Lease, LeaseKey, LeaseLost, Leases, LeaseTiming, in_turn
from services.common.runtime import ServiceContext, supervise
from services.common.settings import Settings
from services.tracker.settings import TrackerSettings

log = logging.getLogger(__name__)

LEASE_SERVICE = "tracker"


class Tracker(Protocol):
    """What ownership needs of the tracker (services.tracker.service.Tracker)."""

    def consumer(self, spec: ConsumerSpec) -> Consumer[Any]: ...
    async def tick(self) -> None: ...
    def forget(self) -> None: ...
    async def close(self) -> None: ...


def given_partition(settings: Settings) -> int | None:
    """The partition this process was told to consume (GREYHOUND_TRACKER_PARTITION set, or
    passed in), or None: any free one."""
    return settings.tracker_partition if "tracker_partition" in settings.model_fields_set else None


def lease_keys(settings: Settings) -> list[LeaseKey]:
    """The partitions this process asks for, in order."""
    return [LeaseKey(LEASE_SERVICE, i)
            for i in in_turn(settings.tracker_partitions, given_partition(settings))]


async def consume(tracker: Tracker, ctx: ServiceContext, partition: int, stop: asyncio.Event, *,
                  lease: Lease | None = None, leases: Leases | None = None) -> None:
    """Consume ``partition`` until ``stop`` (then save what changed), or until ``lease`` is lost
    (LeaseLost; the jobs dropped from memory unsaved)."""
    spec = tracker_spec(ctx.settings.model_copy(update={"tracker_partition": partition}))
    consumer = tracker.consumer(spec)

    async def stopper() -> None:
        await stop.wait()
        consumer.stop()

    tasks = [consumer.run(idle=tracker.tick), stopper()]
    if lease is not None and leases is not None:
        tasks += [lease.watch(until=stop), leases.heartbeat(stop)]
    try:
        await supervise(*tasks)
    except LeaseLost:
        tracker.forget()
        raise
    finally:
        if lease is None or lease.held:
            await tracker.close()


async def own_partitions(tracker: Tracker, ctx: ServiceContext, settings: TrackerSettings,
                         stop: asyncio.Event) -> None:
    """Hold a partition's lease and consume it, again after a loss, until ``stop``."""
    if ctx.sessions is None:
        await consume(tracker, ctx, ctx.settings.tracker_partition, stop)
        return
    keys = lease_keys(ctx.settings)
    timing = LeaseTiming.for_validity(settings.tracker_lease_valid_s,
                                      settings.tracker_lease_retry_s)
    async with Leases(ctx.backends.database_url, timing=timing) as leases:
        while not stop.is_set():
            lease = await leases.acquire_first(keys, stop)
            if lease is None:
                return
            p = lease.key.partition
            log.info("tracker owns partition %d of %d", p, ctx.settings.tracker_partitions)
            try:
                await consume(tracker, ctx, p, stop, lease=lease, leases=leases)
            except LeaseLost as exc:
                log.warning("tracker stopped consuming partition %d: %s; asking for a partition "
                            "again", p, exc)
            # what this session may still lock (a confirmation late, not refused) is freed
            await leases.release(lease)
