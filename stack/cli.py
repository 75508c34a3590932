"""The ``greyhound`` command.

One subcommand per service of the registry (services.registry), ``up`` (all of them), ``db``,
``demo``, and the library's offline ``detect``, ``sim`` and ``plan``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from services.common.runtime import resolve_backends, start_service
from services.common.settings import Settings, get_settings
from services.registry import SERVICES, Service
from stack.demo_faults import FAULT_KINDS

if TYPE_CHECKING:
    from greyhound.sim.scenario import Scenario


def _install_stop(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


async def _serve(service: Service, options: dict[str, Any]) -> None:
    stop = asyncio.Event()
    _install_stop(asyncio.get_running_loop(), stop)
    ctx = await start_service(service.name, get_settings(), need_db=service.postgres,
                              bus_user=service.bus_user(options))
    try:
        await service.run(ctx, stop, options)
    finally:
        await ctx.close()


def cmd_service(args: argparse.Namespace) -> int:
    """Any service of the registry: connect as it needs, then run its entry point."""
    service: Service = args.service
    asyncio.run(_serve(service, {o.dest: getattr(args, o.dest) for o in service.cli_options()}))
    return 0


def cmd_db_upgrade(_: argparse.Namespace) -> int:
    from services.common.db.migrate import upgrade

    backends = resolve_backends(get_settings())
    try:
        upgrade(backends.database_url)
    finally:
        backends.stop()
    print("database schema is at the newest revision")
    return 0


def cmd_token(args: argparse.Namespace) -> int:
    from services.api.token_cli import run

    return run(get_settings(), args)


def cmd_up(args: argparse.Namespace) -> int:
    from stack.up import Stack

    settings = get_settings()
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    with Stack(settings, host=args.host, port=args.port) as stack:
        print(f"greyhound is up: REST API on http://{args.host}:{args.port} "
              f"(data in {settings.data_dir}); Ctrl-C stops it", flush=True)
        while not stop:
            dead = stack.dead()
            if dead:
                print(f"service(s) {', '.join(dead)} exited; stopping (see "
                      f"{settings.data_dir}/logs)", file=sys.stderr)
                return 1
            time.sleep(0.5)
    print("greyhound stopped")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from stack.demo import run_demo

    return run_demo(get_settings(), fault=args.fault, ranks=args.ranks, rank=args.rank,
                    factor=args.factor, at=args.at, port=args.port, timeout_s=args.timeout)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="greyhound", description=__doc__.split("\n\n")[0])
    p.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default from settings)")
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start every service (embedded NATS/Postgres when no URLs are set)")
    up.add_argument("--host", default=None)
    up.add_argument("--port", type=int, default=None)
    up.set_defaults(func=cmd_up)

    for service in SERVICES:
        sp = sub.add_parser(service.name, help=service.help)
        for opt in service.cli_options():
            sp.add_argument(opt.flag, type=opt.type, default=None, help=opt.help,
                            action="append" if opt.repeat else "store")
        sp.set_defaults(func=cmd_service, service=service)

    db = sub.add_parser("db", help="database administration")
    dbsub = db.add_subparsers(dest="db_command", required=True)
    dbsub.add_parser("upgrade", help="migrate the schema to the newest revision").set_defaults(
        func=cmd_db_upgrade)

    from services.api.token_cli import add_parser as add_token_parser

    add_token_parser(sub)
    sub.choices["token"].set_defaults(func=cmd_token)

    demo = sub.add_parser("demo", help="a small fake-NCCL job with one fault, found end to end")
    demo.add_argument("--fault", choices=FAULT_KINDS, default="slow",
                      help="a slow GPU (default), a slow link between two ranks, a collective "
                      "that never completes on one rank's GPU, a slow GPU in a job whose DP "
                      "communicators are used only inside groups (grouped), or a slow link "
                      "whose validation loses a node's agent mid-benchmark (bench-peer-dies)")
    demo.add_argument("--ranks", type=int, default=4)
    demo.add_argument("--rank", "--slow-rank", dest="rank", type=int, default=None,
                      help="the slow GPU, the hung rank, or the slow link's first end (the other "
                      "is the next rank); default 2, 2, 1")
    demo.add_argument("--factor", type=float, default=None,
                      help="how much slower (slow: 1.5, link: 4)")
    demo.add_argument("--at", "--slow-from", dest="at", type=int, default=100,
                      help="the iteration at which the fault is injected")
    demo.add_argument("--timeout", type=float, default=60.0,
                      help="seconds after the fault to wait for the incident")
    demo.add_argument("--port", type=int, default=None)
    demo.set_defaults(func=cmd_demo)

    det = sub.add_parser("detect", help="offline change-point detection on trace files",
                         add_help=False)
    det.set_defaults(func=None, passthrough="detect")
    sim = sub.add_parser("sim", help="the cluster simulator", add_help=False)
    sim.set_defaults(func=None, passthrough="sim")
    plan = sub.add_parser("plan", help="mitigation plans, offline (plan microbatch ...)",
                          add_help=False)
    plan.set_defaults(func=None, passthrough="plan")
    return p


def _sim_live(scenario: Scenario, args: argparse.Namespace) -> int:
    """Imported only for a live run, so that offline sweeps never load the services."""
    from stack.sim_live import run_from_args

    return run_from_args(scenario, args)


def _passthrough(argv: Sequence[str]) -> int | None:
    """``detect``, ``sim`` and ``plan`` own their argument parsing; hand them the rest of the line."""
    if argv and argv[0] == "detect":
        from greyhound.detect_cli import main as detect_main

        return detect_main(list(argv[1:]))
    if argv and argv[0] == "sim":
        from greyhound.sim.cli import main as sim_main

        return sim_main(list(argv[1:]), live=_sim_live)
    if argv and argv[0] == "plan":
        from greyhound.plan_cli import main as plan_main

        return plan_main(list(argv[1:]))
    return None


def main(argv: Sequence[str] | None = None) -> int:
    # pgserver's platformdirs warns when XDG_RUNTIME_DIR is unset; it falls back correctly.
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    argv = list(sys.argv[1:] if argv is None else argv)
    rc = _passthrough(argv)
    if rc is not None:
        return rc
    args = build_parser().parse_args(argv)
    settings: Settings = get_settings()
    logging.basicConfig(level=(args.log_level or settings.log_level).upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for chatty in ("pgserver", "alembic", "httpx"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
    if getattr(args, "host", "unset") is None or getattr(args, "port", "unset") is None:
        from services.api.settings import ApiSettings

        api = ApiSettings()  # the API's own settings say where it listens
        if getattr(args, "host", "unset") is None:
            args.host = api.api_host
        if getattr(args, "port", "unset") is None:
            args.port = api.api_port
    rc = args.func(args)
    return int(rc)


def run() -> int:
    """Console entry point: a closed stdout (``| head``) ends the command quietly."""
    try:
        return main()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(run())
