"""What each service may do on the bus, one entry per service: the subjects it publishes (or
sends requests on), the durable consumers it binds, the streams it reads, the requests it
answers. The server's users and permissions are generated from this table
(services.common.bus.permissions: the embedded server's config, deploy/nats/greyhound.conf) and
each service checks its own entry when it starts (services.common.bus.preflight), so a service
that is not granted a right here is refused it by the server: a new subject or consumer needs
its entry updated.

Data only, below the services: ``services.registry`` (which runs them) names each service, and
this table says what that name may do.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.bus import streams
from services.common.bus.auth import agent_user, default_agent_id
from services.common.bus.contract import Subjects
from services.common.bus.streams import ConsumerSpec


@dataclass(frozen=True, slots=True)
class Consume:
    """A durable consumer a service binds: ``partitioned`` when there is one per partition of
    the jobs (GREYHOUND_TRACKER_PARTITIONS; the name then follows streams.partition_durable)."""

    stream: str
    durable: str
    partitioned: bool = False

    @staticmethod
    def of(spec: ConsumerSpec, *, partitioned: bool = False) -> Consume:
        return Consume(spec.stream, spec.durable, partitioned)


@dataclass(frozen=True, slots=True)
class BusAccess:
    """What a service may do on the bus (see the module docstring); nothing by default."""

    publish: tuple[str, ...] = ()  # subjects (wildcards allowed) it publishes or requests on
    consume: tuple[Consume, ...] = ()  # durables it binds, fetches, acks and dead-letters for
    read: tuple[str, ...] = ()  # streams it reads with short-lived consumers of its own
    serve: tuple[str, ...] = ()  # request subjects it answers
    object_stores: tuple[str, ...] = ()  # JetStream object-store buckets it keeps state in
    monitor: bool = False  # reads stream and consumer state (metrics, readiness)
    declare_streams: bool = True  # creates/updates the streams on start
    # One bus user per agent id (agent-<id>): the last token of every publish and serve subject
    # (the agent id in the contract's per-agent subjects) is bound to that id.
    per_agent: bool = False


GRANTS: dict[str, BusAccess] = {
    "tracker": BusAccess(publish=(Subjects.ALL_DETECTIONS,),
                         consume=(Consume.of(streams.TRACKER, partitioned=True),),
                         # a job's telemetry since its saved state, after a restart
                         read=(streams.TELEMETRY,), object_stores=("gh-tracker-state",)),
    "analyzer": BusAccess(publish=(Subjects.ALL_INCIDENTS, Subjects.ALL_SUSPICIONS,
                                   Subjects.ALL_CONTROL),
                          consume=(Consume.of(streams.ANALYZER, partitioned=True),
                                   Consume.of(streams.ANALYZER_COLLECTIVES, partitioned=True))),
    "validator": BusAccess(publish=(Subjects.ALL_INCIDENTS, Subjects.ALL_CONTROL,
                                    Subjects.ALL_VALIDATION),
                           consume=(Consume.of(streams.VALIDATOR),)),
    # Re-checks of a mitigated incident are suspicions; plans and the incident's plan notes
    # are its own to publish; the iteration watch reads telemetry with consumers of its own.
    "planner": BusAccess(publish=(Subjects.ALL_PLANS, Subjects.ALL_SUSPICIONS,
                                  Subjects.ALL_INCIDENTS),
                         consume=(Consume.of(streams.PLANNER, partitioned=True),),
                         read=(streams.TELEMETRY,)),
    "api": BusAccess(publish=(Subjects.ALL_INCIDENTS, Subjects.ALL_PLAN_REPORTS),
                     read=(streams.TELEMETRY,), monitor=True),
    "notifier": BusAccess(consume=(Consume(streams.EVENTS, "notifier"),)),
    "agent": BusAccess(publish=(Subjects.ALL_HELLO, Subjects.ALL_ITERATIONS,
                                Subjects.ALL_COUNTERS, Subjects.ALL_COLLECTIVES,
                                Subjects.ALL_GPU_HEALTH),
                       serve=(Subjects.ALL_CONTROL, Subjects.ALL_VALIDATION),
                       declare_streams=False, per_agent=True),
}


def bus_user(service: str, agent_id: str | None = None) -> str:
    """The NATS user ``service`` connects as: its name, or for a service with a user per agent
    (the node agent) ``agent-<id>`` (by default this host's)."""
    if not GRANTS[service].per_agent:
        return service
    return agent_user(agent_id or default_agent_id())
