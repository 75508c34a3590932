"""The service registry is the one list: compose, the CLI and the entry points agree with it."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common.bus.grants import GRANTS
from services.registry import BY_NAME, SERVICES, UP, Option, Service
from stack.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
INFRASTRUCTURE = {"init", "nats", "postgres", "migrate", "streams"}  # run by compose, not Greyhound services


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((REPO / "deploy/compose.yaml").read_text())
    services: dict[str, Any] = loaded["services"]
    return services


def test_the_bus_grants_are_the_registered_services() -> None:
    """services.common.bus.grants (below the services) and the registry (above them) name the
    same services: none runs without grants, no user is granted for a service nobody runs."""
    assert set(GRANTS) == set(BY_NAME)


def test_compose_runs_exactly_the_registered_services() -> None:
    assert set(compose()) - INFRASTRUCTURE == set(BY_NAME)


@pytest.mark.parametrize("service", SERVICES, ids=lambda s: s.name)
def test_each_compose_service_is_run_as_the_registry_says(service: Service) -> None:
    spec = compose()[service.name]
    command = spec["command"]
    assert command[0] == service.name
    flags = {a for a in command[1:] if a.startswith("--")}
    assert flags <= {o.flag for o in service.cli_options()}, "compose passes an unknown option"
    assert ({"--host", "--port"} <= flags) == service.http
    # a node service runs on the training hosts (opt-in profile, their /dev/shm), not centrally
    assert bool(spec.get("profiles")) == service.on_nodes
    assert ("/dev/shm:/dev/shm" in spec.get("volumes", [])) == service.on_nodes
    if service.postgres:
        assert "postgres" in spec["depends_on"] and "GREYHOUND_DATABASE_URL" in spec["environment"]


@pytest.mark.parametrize("service", SERVICES, ids=lambda s: s.name)
def test_each_entry_point_takes_context_stop_and_its_options(service: Service) -> None:
    main = service.load()
    assert inspect.iscoroutinefunction(main)
    params = inspect.signature(main).parameters
    positional = [p for p in params.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in positional[:2]] == ["ctx", "stop"]
    for opt in service.cli_options():
        assert opt.dest in params, f"{service.entry} has no keyword {opt.dest}"
    required = [p.name for p in list(params.values())[2:] if p.default is p.empty]
    assert set(required) <= {o.dest for o in service.cli_options()}


def test_the_cli_has_one_subcommand_per_service_with_its_options() -> None:
    parser = build_parser()
    args = parser.parse_args(["agent", "--job", "a", "--job", "b", "--agent-id", "n1"])
    assert args.service is BY_NAME["agent"] and args.job == ["a", "b"] and args.agent_id == "n1"
    args = parser.parse_args(["api", "--port", "9000"])
    assert args.service is BY_NAME["api"] and args.port == 9000 and args.host is None
    for service in SERVICES:
        assert parser.parse_args([service.name]).service is service
    with pytest.raises(SystemExit):
        parser.parse_args(["tracker", "--port", "1"])  # options are per service


def test_up_starts_the_services_marked_for_it() -> None:
    assert tuple(s.name for s in SERVICES if s.in_up) == UP
    assert {"tracker", "analyzer", "validator", "planner", "api", "agent"} <= set(UP)


seen: list[tuple[object, object, dict[str, Any]]] = []


async def fake_main(ctx: object, stop: object, *, job: list[str] | None = None,
                    agent_id: str | None = None) -> None:
    seen.append((ctx, stop, {"job": job, "agent_id": agent_id}))


def test_a_service_runs_its_entry_with_its_options_by_name() -> None:
    service = Service("fake", f"{__name__}:fake_main", "a test service",
                      options=(Option("--job", "jobs", repeat=True), Option("--agent-id", "id")))
    stop = asyncio.Event()
    asyncio.run(service.run("ctx", stop, {"job": ["j"], "agent_id": "a", "unrelated": 1}))
    assert seen == [("ctx", stop, {"job": ["j"], "agent_id": "a"})]
    with pytest.raises(ValueError, match="module:function"):
        Service("bad", "services.nothing", "no function named")
