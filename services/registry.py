"""Every Greyhound service, one line each: the ``greyhound`` command's service subcommands,
``greyhound up``, deploy/compose.yaml and the bus's permissions are built from this table or
checked against it.

A new service is a folder (``services/<name>/service.py`` with its entry point, and its own
``settings.py`` if it has knobs) and one line here. An entry point is
``async def run_<name>(ctx: ServiceContext, stop: asyncio.Event, *, <one keyword per option>)``:
the caller has connected to NATS (and Postgres when needed), declared the streams and run the
migrations; the service returns once ``stop`` is set, or raises when it cannot go on (the
process then exits for its supervisor, ``greyhound up`` or compose, to act on).

A line's ``bus`` says what the service may do on NATS: the subjects it publishes (or sends
requests on), the durable consumers it binds, the streams it reads, the requests it answers.
The server's users and permissions are generated from it (services.common.bus.permissions:
the embedded server's config, deploy/nats/greyhound.conf), so a service that is not given a
right here is refused it by the server: a new subject or consumer needs its line updated.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.common.bus.auth import agent_user, default_agent_id
from services.common.bus.contract import Subjects
from services.common.bus.streams import (
    ANALYZER,
    ANALYZER_COLLECTIVES,
    EVENTS,
    PLANNER,
    TELEMETRY,
    TRACKER,
    VALIDATOR,
    ConsumerSpec,
)

if TYPE_CHECKING:
    from services.common.runtime import ServiceContext

ServiceMain = Callable[..., Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Option:
    """One command-line option of a service's subcommand, passed to its entry point by name."""

    flag: str  # "--agent-id": the keyword is agent_id
    help: str
    type: Callable[[str], Any] = str
    repeat: bool = False  # may be given several times; the keyword gets a list (None if never)

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


@dataclass(frozen=True, slots=True)
class Consume:
    """A durable consumer a service binds: ``partitioned`` when there is one per tracker
    partition (the durable name then follows streams.tracker_spec)."""

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


@dataclass(frozen=True, slots=True)
class Service:
    name: str
    entry: str  # "package.module:function"
    help: str
    postgres: bool = True  # every service talks to NATS; this says whether it needs Postgres too
    in_up: bool = True  # ``greyhound up`` starts it
    on_nodes: bool = False  # runs on every training host, next to the rings, not centrally
    http: bool = False  # serves HTTP: --host and --port (``greyhound up`` passes its own)
    options: tuple[Option, ...] = ()
    bus: BusAccess = BusAccess()

    def __post_init__(self) -> None:
        if ":" not in self.entry:
            raise ValueError(f"service {self.name}: entry {self.entry!r} is not module:function")

    def cli_options(self) -> tuple[Option, ...]:
        bind = (Option("--host", "bind address (default: settings)"),
                Option("--port", "port (default: settings)", type=int)) if self.http else ()
        return (*bind, *self.options)

    def bus_user(self, options: dict[str, Any] | None = None) -> str:
        """The NATS user this service connects as (an agent's names its agent id)."""
        if not self.bus.per_agent:
            return self.name
        return agent_user((options or {}).get("agent_id") or default_agent_id())

    def load(self) -> ServiceMain:
        """The entry point, imported only now (a service's dependencies load with it)."""
        module, _, func = self.entry.partition(":")
        main: ServiceMain = getattr(importlib.import_module(module), func)
        return main

    async def run(self, ctx: ServiceContext, stop: asyncio.Event, options: dict[str, Any]) -> None:
        await self.load()(ctx, stop, **{o.dest: options[o.dest] for o in self.cli_options()})


SERVICES: tuple[Service, ...] = (
    Service("tracker", "services.tracker.service:run_tracker", "run the tracker service",
            bus=BusAccess(publish=(Subjects.ALL_DETECTIONS,),
                          consume=(Consume.of(TRACKER, partitioned=True),),
                          # a job's telemetry since its saved state, after a restart
                          read=(TELEMETRY,), object_stores=("gh-tracker-state",))),
    Service("analyzer", "services.analyzer.service:run_analyzer", "run the analyzer service",
            bus=BusAccess(publish=(Subjects.ALL_INCIDENTS, Subjects.ALL_SUSPICIONS,
                                   Subjects.ALL_CONTROL),
                          consume=(Consume.of(ANALYZER), Consume.of(ANALYZER_COLLECTIVES)))),
    Service("validator", "services.validator.service:run_validator",
            "run the validator service (pauses and benchmarks suspects)",
            bus=BusAccess(publish=(Subjects.ALL_INCIDENTS, Subjects.ALL_CONTROL,
                                   Subjects.ALL_VALIDATION),
                          consume=(Consume.of(VALIDATOR),))),
    # Re-checks of a mitigated incident are suspicions; plans and the incident's plan notes
    # are its own to publish; the iteration watch reads telemetry with consumers of its own.
    Service("planner", "services.planner.service:run_planner",
            "run the planner service (ski-rental escalation, plans, delivery to jobs)",
            bus=BusAccess(publish=(Subjects.ALL_PLANS, Subjects.ALL_SUSPICIONS,
                                   Subjects.ALL_INCIDENTS),
                          consume=(Consume.of(PLANNER),), read=(TELEMETRY,))),
    Service("api", "services.api.service:run_api", "run the REST API service", http=True,
            bus=BusAccess(publish=(Subjects.ALL_INCIDENTS, Subjects.ALL_PLAN_REPORTS),
                          read=(TELEMETRY,), monitor=True)),
    Service("notifier", "services.notifier.service:run_notifier",
            "run the notifier service (signed webhooks to on-call)",
            bus=BusAccess(consume=(Consume(EVENTS, "notifier"),))),
    Service("agent", "services.agent.service:run_agent",
            "run the node agent (drains the hook's rings)", postgres=False, on_nodes=True,
            options=(Option("--job", "only these job ids (repeatable)", repeat=True),
                     Option("--agent-id", "default: the host name")),
            bus=BusAccess(publish=(Subjects.ALL_HELLO, Subjects.ALL_ITERATIONS,
                                   Subjects.ALL_COUNTERS, Subjects.ALL_COLLECTIVES,
                                   Subjects.ALL_GPU_HEALTH),
                          serve=(Subjects.ALL_CONTROL, Subjects.ALL_VALIDATION),
                          declare_streams=False, per_agent=True)),
)
BY_NAME = {s.name: s for s in SERVICES}
UP = tuple(s.name for s in SERVICES if s.in_up)
