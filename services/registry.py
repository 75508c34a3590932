"""Every Greyhound service, one line each: the ``greyhound`` command's service subcommands,
``greyhound up`` and deploy/compose.yaml are built from this table or checked against it.

A new service is a folder (``services/<name>/service.py`` with its entry point, and its own
``settings.py`` if it has knobs) and one line here. An entry point is
``async def run_<name>(ctx: ServiceContext, stop: asyncio.Event, *, <one keyword per option>)``:
the caller has connected to NATS (and Postgres when needed), declared the streams and run the
migrations; the service returns once ``stop`` is set, or raises when it cannot go on (the
process then exits for its supervisor, ``greyhound up`` or compose, to act on).

What a service may do on NATS is its entry in services.common.bus.grants (``Service.bus``),
from which the bus's users and permissions are generated: a table below the services, so that
what configures the bus never loads this registry, which sits above them (it imports their
entry points).
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.common.bus import grants
from services.common.bus.grants import BusAccess

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
class Service:
    name: str
    entry: str  # "package.module:function"
    help: str
    postgres: bool = True  # every service talks to NATS; this says whether it needs Postgres too
    in_up: bool = True  # ``greyhound up`` starts it
    on_nodes: bool = False  # runs on every training host, next to the rings, not centrally
    http: bool = False  # serves HTTP: --host and --port (``greyhound up`` passes its own)
    options: tuple[Option, ...] = ()

    def __post_init__(self) -> None:
        if ":" not in self.entry:
            raise ValueError(f"service {self.name}: entry {self.entry!r} is not module:function")

    @property
    def bus(self) -> BusAccess:
        """What it may do on the bus (services.common.bus.grants)."""
        return grants.GRANTS[self.name]

    def cli_options(self) -> tuple[Option, ...]:
        bind = (Option("--host", "bind address (default: settings)"),
                Option("--port", "port (default: settings)", type=int)) if self.http else ()
        return (*bind, *self.options)

    def bus_user(self, options: dict[str, Any] | None = None) -> str:
        """The NATS user this service connects as (an agent's names its agent id)."""
        return grants.bus_user(self.name, (options or {}).get("agent_id"))

    def load(self) -> ServiceMain:
        """The entry point, imported only now (a service's dependencies load with it)."""
        module, _, func = self.entry.partition(":")
        main: ServiceMain = getattr(importlib.import_module(module), func)
        return main

    async def run(self, ctx: ServiceContext, stop: asyncio.Event, options: dict[str, Any]) -> None:
        await self.load()(ctx, stop, **{o.dest: options[o.dest] for o in self.cli_options()})


SERVICES: tuple[Service, ...] = (
    Service("tracker", "services.tracker.service:run_tracker", "run the tracker service"),
    Service("analyzer", "services.analyzer.service:run_analyzer", "run the analyzer service"),
    Service("validator", "services.validator.service:run_validator",
            "run the validator service (pauses and benchmarks suspects)"),
    Service("planner", "services.planner.service:run_planner",
            "run the planner service (ski-rental escalation, plans, delivery to jobs)"),
    Service("api", "services.api.service:run_api", "run the REST API service", http=True),
    Service("notifier", "services.notifier.service:run_notifier",
            "run the notifier service (signed webhooks to on-call)"),
    Service("agent", "services.agent.service:run_agent",
            "run the node agent (drains the hook's rings)", postgres=False, on_nodes=True,
            options=(Option("--job", "only these job ids (repeatable)", repeat=True),
                     Option("--agent-id", "default: the host name"))),
)
BY_NAME = {s.name: s for s in SERVICES}
UP = tuple(s.name for s in SERVICES if s.in_up)
