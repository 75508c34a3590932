"""``greyhound sim run SCENARIO.yaml [--offline] [--speed X] [--json] [--port P] [--serve]``.

``--offline`` prints one iteration time in seconds per line (the input of ``greyhound detect``).
Without it the scenario runs live through the whole stack, which the library does not know:
the ``greyhound`` command (stack.cli) passes ``live``, the runner that starts the services, so
that offline sweeps never load them. ``python -m greyhound.sim.cli`` runs offline only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from greyhound.sim.offline import run_offline
from greyhound.sim.scenario import Scenario, ScenarioError, load_scenario

LiveRunner = Callable[[Scenario, argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="greyhound sim")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a scenario")
    run.add_argument("scenario", type=Path)
    run.add_argument("--offline", action="store_true", help="print iteration times only")
    run.add_argument("--speed", type=float, default=None, help="cap virtual/wall time ratio")
    run.add_argument("--json", action="store_true", help="print incidents as JSON lines")
    run.add_argument("--port", type=int, default=None, help="REST API port (default: settings)")
    run.add_argument("--settle", type=float, default=5.0,
                     help="seconds to let the services finish after the run")
    run.add_argument("--serve", action="store_true",
                     help="live: keep the services (REST API, dashboard) serving after the run "
                     "until Ctrl-C")
    return parser


def main(argv: Sequence[str], live: LiveRunner | None = None) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        scenario = load_scenario(args.scenario)
    except (OSError, ScenarioError) as exc:
        print(f"greyhound sim: {args.scenario}: {exc}", file=sys.stderr)
        return 2
    if args.json and args.offline:
        print("greyhound sim: --json reports incidents, which only a live run produces",
              file=sys.stderr)
        return 2
    if args.serve and args.offline:
        print("greyhound sim: --serve keeps a live run's services serving; an offline run has "
              "none", file=sys.stderr)
        return 2
    if args.speed is not None and args.speed <= 0:
        print("greyhound sim: --speed must be positive", file=sys.stderr)
        return 2
    if not args.offline:
        if live is None:
            print("greyhound sim: a live run needs the services; run it with the greyhound "
                  "command, or pass --offline", file=sys.stderr)
            return 2
        return live(scenario, args)
    out = sys.stdout
    for seconds in run_offline(scenario):
        out.write(f"{seconds:.6f}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
