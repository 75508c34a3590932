"""Planner: validated incidents in, plans out; the one owner of plans and of what jobs run.

Per validated incident it keeps GREYHOUND's ski-rental escalation (greyhound.core.escalation):
the cumulative loss over the job's iterations (read from the telemetry stream for that job
only, from a little before its slowdown: services.planner.iterations), and when the loss reaches
the next strategy's overhead, that strategy's plan built from the validated culprit
(greyhound.core.plan_build). A plan is proposed; its strategy's policy approves it at once
(automatic) or leaves it to an operator over REST, until it expires; an approved plan is
delivered as the job's next version (services.planner.delivery: the ``plans`` and
``plan_deliveries`` rows, ``Subjects.plan(job)``, ``GET /v1/jobs/{id}/plan``); the job's report
(``POST /v1/jobs/{id}/plan/applied`` -> ``Subjects.plan_report``) moves the plan to applied (the
incident to mitigated) and teaches the escalation what the strategy really cost.

The fault's end takes the plans back (delivered like plans). A tracker recovery that the plan
itself explains (it took effect just before, or the level it left is the pre-plan level) is not
an end: the plan stays, and while it does, a slow GPU is re-validated every ``recheck_s``
(a Suspicion to the validator); a verdict that finds it healthy again reverts the plan.

Every message is staged in the transaction that commits the change it announces (the
transactional outbox, services.common.outbox) and sent after the commit; what a failed send or a
killed process leaves, the outbox relay sends. Consumed events are claimed in the
processed-events ledger, so a redelivery does nothing twice.

One object holds the planner's state (services.planner.state); its message handlers
(services.planner.handlers), an incident's escalation (services.planner.escalations) and the
periodic round (services.planner.rounds) are functions over it, and ``Planner`` is the small
orchestrator that owns it: a unit of work per message, the handler its kind calls for, the
round on a timer.

Split by job over several processes (``GREYHOUND_TRACKER_PARTITIONS``, services.common
.ownership): a process plans for one partition's jobs while it holds that partition's lease:
it restores their escalations as last saved, consumes their events, and its round delivers,
expires and re-checks their plans only; losing the lease it drops them unsaved (the next owner
restores them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from greyhound.core.tracked_incident import Tracked
from services.common.bus.client import Consumer
from services.common.bus.contract import DetectionEvent, IncidentEvent, PlanReport
from services.common.bus.streams import PLANNER, ConsumerSpec, partitioned
from services.common.ownership import Ownership, Partition, own_partitions
from services.common.runtime import ServiceContext, supervise
from services.common.unit_of_work import UnitOfWork
from services.planner import escalations, handlers, rounds
from services.planner.settings import PlannerSettings
from services.planner.state import PlannerState

log = logging.getLogger(__name__)

Event = IncidentEvent | DetectionEvent | PlanReport


class Planner:
    """The planner's state and what runs over it (see the module docstring)."""

    def __init__(self, ctx: ServiceContext, settings: PlannerSettings) -> None:
        self.state = PlannerState.of(ctx, settings, self._observe)

    async def _observe(self, job: str, new: list[float]) -> None:
        await escalations.observe(self.state, job, new)

    @property
    def config(self) -> PlannerSettings:
        return self.state.config

    @property
    def tracked(self) -> dict[str, Tracked]:
        return self.state.tracked

    async def consume(self, subject: str, msg: Event) -> None:
        """What the consumer calls: ``handle`` in a unit of work of its own, incident events
        and plan reports claimed in the processed-events ledger under the service's one name,
        whichever partition's durable delivers them (a detection only starts or judges a watch,
        which is done twice harmlessly)."""
        await self.state.work.per_message(
            self.handle, claim=PLANNER.durable,
            claims=lambda m: not isinstance(m, DetectionEvent))(subject, msg)

    async def handle(self, uow: UnitOfWork, subject: str, msg: Event) -> None:
        if isinstance(msg, PlanReport):
            await handlers.report(self.state, uow, msg)
        elif isinstance(msg, DetectionEvent):
            await handlers.detection(self.state, uow, msg)
        elif msg.stage == "validated":
            await handlers.validated(self.state, uow, msg)
        elif msg.stage == "resolved":
            await handlers.resolved(self.state, uow, msg)

    async def tick(self) -> None:
        await rounds.tick(self.state)

    async def restore(self) -> None:
        await rounds.restore(self.state)

    async def close(self) -> None:
        await rounds.close(self.state)


@dataclass
class PlannerOwner:
    """The planner as a partition's owner (services.common.ownership): the escalations of the
    partition's jobs restored, its events consumed, the round over them on a timer."""

    planner: Planner
    spec: ConsumerSpec = PLANNER
    consumer: Consumer[Event] | None = None  # the partition's, now

    async def serve(self, part: Partition, stop: asyncio.Event) -> None:
        planner, st = self.planner, self.planner.state
        st.part = part
        await planner.restore()
        consumer: Consumer[Event] = Consumer(
            st.ctx.js, partitioned(self.spec, part.index, part.count), Event, planner.consume,
            ready=st.work.writable, jobs=part.owns)
        self.consumer = consumer

        async def ticker() -> None:
            while not stop.is_set():
                try:
                    await planner.tick()
                except Exception:  # one failed round must not stop planning; the next retries
                    log.exception("planner tick failed")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), planner.config.poll_s)

        async def stopper() -> None:
            await stop.wait()
            consumer.stop()

        await supervise(consumer.run(), ticker(), stopper())

    async def forget(self) -> None:
        await self.planner.state.drop_all()

    async def close(self) -> None:
        await self.planner.close()


async def run_planner(ctx: ServiceContext, stop: asyncio.Event,
                      settings: PlannerSettings | None = None, *,
                      planner: Planner | None = None, spec: ConsumerSpec = PLANNER) -> None:
    """The service: its settings from the environment unless given; the partition whose lease
    it holds, and the outbox relay; ends when ``stop`` is set, or raises when its consumer
    cannot go on (the process exits for its supervisor)."""
    planner = planner or Planner(ctx, settings or PlannerSettings())
    c = planner.config
    plan = Ownership.of("planner", ctx.settings.tracker_partitions, c.partition,
                        valid_s=c.lease_valid_s,
                        retry_s=c.lease_retry_s)
    await supervise(own_partitions(PlannerOwner(planner, spec), plan, ctx.backends.database_url,
                                   stop),
                    planner.state.work.relay(stop))


__all__: Sequence[str] = ("Planner", "PlannerOwner", "run_planner")
