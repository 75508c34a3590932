"""The ``greyhound`` command.

One subcommand per service of the registry (services.registry), ``up`` (all of them), ``db``,
``streams``, ``dlq`` (the dead letters), ``demo``, ``run`` (a training command with the hook and
a plan client), and the library's offline ``detect``, ``sim`` and ``plan``. The services and the
registry are imported only by the subcommands that need them: ``token`` (made while a plan
waits for an operator) and the offline commands load neither the bus nor the services.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.settings import Settings, get_settings

if TYPE_CHECKING:
    from greyhound.sim.scenario import Scenario
    from services.registry import Service


def _db_settings() -> Settings:
    """This process's settings for a command that uses the database: on the data directory's
    embedded Postgres, with its token and webhook keys (services.common.data_keys)."""
    from services.common.data_keys import with_data_dir_keys

    return with_data_dir_keys(get_settings())


def _install_stop(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


async def _serve(service: Service, options: dict[str, Any]) -> None:
    from services.common.runtime import start_service

    stop = asyncio.Event()
    _install_stop(asyncio.get_running_loop(), stop)
    settings = _db_settings() if service.postgres else get_settings()
    ctx = await start_service(service.name, settings, need_db=service.postgres,
                              bus_user=service.bus_user(options))
    try:
        await service.run(ctx, stop, options)
    finally:
        await ctx.close()


def cmd_service(args: argparse.Namespace) -> int:
    """Any service of the registry: connect as it needs, then run its entry point. A bus that
    refuses this process (its credentials, or a grant its code needs), or a stream configured
    otherwise than its settings say, is said in one message, not a traceback: it is a setting
    to fix, not a crash."""
    from services.api.tokens import MissingTokenKey
    from services.common.bus.auth import BusAuthError
    from services.common.bus.streams import StreamMismatch

    service: Service = args.service
    try:
        asyncio.run(_serve(service, {o.dest: getattr(args, o.dest)
                                     for o in service.cli_options()}))
    except (BusAuthError, MissingTokenKey, StreamMismatch) as exc:
        logging.getLogger("greyhound").error("%s", exc)
        return 2
    return 0


def cmd_db_upgrade(_: argparse.Namespace) -> int:
    from services.common.db.migrate import upgrade
    from services.common.runtime import resolve_backends

    backends = resolve_backends(get_settings())
    try:
        upgrade(backends.database_url)
    finally:
        backends.stop()
    print("database schema is at the newest revision")
    return 0


def cmd_streams_apply(_: argparse.Namespace) -> int:
    """Create the streams, or bring them to this process's settings: once per deployment and
    after changing GREYHOUND_STREAM_REPLICAS, GREYHOUND_TRACKER_PARTITIONS or a stream limit
    (the services only check, and refuse to start on a stream configured otherwise)."""
    from services.common.bus.auth import BusAuthError
    from services.common.runtime import apply_streams

    try:
        done = asyncio.run(apply_streams(get_settings()))
    except BusAuthError as exc:
        logging.getLogger("greyhound").error("%s", exc)
        return 2
    for name, what in done.items():
        print(f"stream {name}: {what}")
    return 0


def cmd_token(args: argparse.Namespace) -> int:
    from services.api.token_cli import run

    return run(_db_settings(), args)


def cmd_dlq(args: argparse.Namespace) -> int:
    from stack.dlq import run

    return run(get_settings(), args)


def cmd_up(args: argparse.Namespace) -> int:
    from stack.claims import Collision, claim
    from stack.serve import serve_until_stopped, stop_signals
    from stack.up import Stack

    settings = _db_settings()
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(claim(shm_dir=settings.shm_dir, data_dir=settings.data_dir,
                                     host=args.host, port=args.port))
        except Collision as exc:
            print(f"greyhound up: {exc}", file=sys.stderr)
            return 2
        with stop_signals() as stopped, Stack(settings, host=args.host, port=args.port) as stack:
            print(f"greyhound is up: REST API on http://{args.host}:{args.port} "
                  f"(data in {settings.data_dir}); Ctrl-C stops it", flush=True)
            if serve_until_stopped(stack, settings.data_dir, stopped):
                return 1
    print("greyhound stopped")
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    from stack.deploy.cli import run

    return run(args, get_settings())


def cmd_run(args: argparse.Namespace) -> int:
    from stack.run import run

    return run(args, _db_settings())


def cmd_demo(args: argparse.Namespace) -> int:
    if args.fault is not None and args.scenario is not None:
        raise SystemExit("greyhound demo: --scenario plays a scenario three ways; --fault runs "
                         "one small fault: choose one")
    from stack.claims import Collision, claim

    settings = _db_settings()
    try:
        with claim(shm_dir=settings.shm_dir, data_dir=settings.data_dir, host="127.0.0.1",
                   port=args.port):
            if args.fault is None:  # the main job: the paper's experiment (stack.paper_demo)
                from stack.paper_demo import run_paper_demo

                return run_paper_demo(settings, scenario=args.scenario, port=args.port,
                                      chart=args.chart)
            from stack.demo import run_demo

            return run_demo(settings, fault=args.fault, ranks=args.ranks, rank=args.rank,
                            factor=args.factor, at=args.at, port=args.port,
                            timeout_s=args.timeout)
    except Collision as exc:
        print(f"greyhound demo: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    from services.registry import SERVICES

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

    streams = sub.add_parser("streams", help="the bus's JetStream streams")
    ssub = streams.add_subparsers(dest="streams_command", required=True)
    ssub.add_parser("apply", help="create the streams or bring them to these settings (the "
                    "services only check them)").set_defaults(func=cmd_streams_apply)

    from services.api.token_cli import add_parser as add_token_parser

    add_token_parser(sub)
    sub.choices["token"].set_defaults(func=cmd_token)

    from stack.dlq import add_parser as add_dlq_parser

    add_dlq_parser(sub)
    sub.choices["dlq"].set_defaults(func=cmd_dlq)

    from stack.deploy.cli import add_parser as add_deploy_parser

    add_deploy_parser(sub)
    sub.choices["deploy"].set_defaults(func=cmd_deploy)

    from stack.demo_faults import FAULT_KINDS
    from stack.run import add_parser as add_run_parser

    add_run_parser(sub)
    sub.choices["run"].set_defaults(func=cmd_run)

    demo = sub.add_parser("demo", help="the paper's 256-GPU experiment with and without "
                          "Greyhound; --fault: a small fake-NCCL job with one fault")
    demo.add_argument("--scenario", type=Path, default=None,
                      help="play this scenario three ways (default: scenarios/paper-256.yaml)")
    demo.add_argument("--chart", type=Path, default=None,
                      help="where the chart goes (default: <data dir>/demo/<scenario>.png)")
    demo.add_argument("--fault", choices=FAULT_KINDS, default=None,
                      help="instead: one fault in a small fake-NCCL job: a slow GPU, a slow link "
                      "between two ranks, a collective that never completes on one rank's GPU, a "
                      "slow GPU in a job whose DP communicators are used only inside groups "
                      "(grouped), or a slow link whose validation loses a node's agent "
                      "mid-benchmark (bench-peer-dies)")
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
    if argv and argv[0] == "token":
        from services.api.token_cli import main as token_main

        _logging(get_settings().log_level)
        return token_main(list(argv[1:]), _db_settings())
    return None


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for chatty in ("pgserver", "alembic", "httpx"):
        logging.getLogger(chatty).setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    # pgserver's platformdirs warns when XDG_RUNTIME_DIR is unset; it falls back correctly.
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    argv = list(sys.argv[1:] if argv is None else argv)
    rc = _passthrough(argv)
    if rc is not None:
        return rc
    args = build_parser().parse_args(argv)
    settings: Settings = get_settings()
    _logging(args.log_level or settings.log_level)
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
