"""Which partition of the jobs this tracker consumes: the one whose lease it holds
(services.common.ownership, shared with the analyzer and the planner).

GREYHOUND_TRACKER_PARTITION given: the process waits for that partition alone (a standby for
it while another process owns it). Not given: it takes the first free partition of
GREYHOUND_TRACKER_PARTITIONS and, while none is free, asks again every
``tracker_lease_retry_s``. One partition per process: run N trackers for N partitions, and a few
more as standbys.

Taking a partition over needs nothing handed across: each job's state is loaded from the state
store (services.tracker.state_store) when its first message comes, and the batches between the
saved state and that message are read back from the stream (services.tracker.replay), so what
the dead owner observed but had not saved is observed once more and nothing twice. A lost lease
stops the partition's consumer and drops the jobs from memory unsaved; on shutdown the jobs are
saved, then the lease given up.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

from services.common.bus.client import Consumer
from services.common.bus.streams import ConsumerSpec, tracker_spec
from services.common.ownership import Owner, Ownership, Partition
from services.common.ownership import own_partitions as own
from services.common.runtime import ServiceContext, supervise
from services.common.settings import Settings
from services.tracker.settings import TrackerSettings

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


@dataclass
class TrackerOwner:
    """The tracker as a partition's owner: its partition's durable, ticking between fetches."""

    tracker: Tracker
    ctx: ServiceContext

    async def serve(self, part: Partition, stop: asyncio.Event) -> None:
        spec = tracker_spec(self.ctx.settings.model_copy(update={"tracker_partition": part.index}))
        consumer = self.tracker.consumer(spec)

        async def stopper() -> None:
            await stop.wait()
            consumer.stop()

        await supervise(consumer.run(idle=self.tracker.tick), stopper())

    async def forget(self) -> None:
        self.tracker.forget()

    async def close(self) -> None:
        await self.tracker.close()


async def own_partitions(tracker: Tracker, ctx: ServiceContext, settings: TrackerSettings,
                         stop: asyncio.Event) -> None:
    """Hold a partition's lease and consume it, again after a loss, until ``stop``."""
    plan = Ownership.of(LEASE_SERVICE, ctx.settings.tracker_partitions,
                        given_partition(ctx.settings), valid_s=settings.tracker_lease_valid_s,
                        retry_s=settings.tracker_lease_retry_s)
    if ctx.sessions is None:  # no database, no leases: the partition configured
        plan = Ownership(LEASE_SERVICE, ctx.settings.tracker_partitions,
                         ctx.settings.tracker_partition)
    owner: Owner = TrackerOwner(tracker, ctx)
    await own(owner, plan, ctx.backends.database_url if ctx.sessions is not None else None, stop)
