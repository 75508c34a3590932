"""``greyhound sim run SCENARIO.yaml [--offline] [--speed X] [--json]``.

Only ``--offline`` runs here (one iteration time in seconds per line: the input of
``greyhound detect``); the live run needs the services and is wired by ``greyhound.cli``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from greyhound.sim.offline import run_offline
from greyhound.sim.scenario import ScenarioError, load_scenario


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="greyhound sim")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a scenario")
    run.add_argument("scenario", type=Path)
    run.add_argument("--offline", action="store_true", help="print iteration times only")
    run.add_argument("--speed", type=float, default=None, help="cap virtual/wall time ratio")
    run.add_argument("--json", action="store_true", help="print incidents as JSON lines")
    args = parser.parse_args(list(argv))
    try:
        scenario = load_scenario(args.scenario)
    except (OSError, ScenarioError) as exc:
        print(f"greyhound sim: {args.scenario}: {exc}", file=sys.stderr)
        return 2
    if args.json and args.offline:
        print("greyhound sim: --json reports incidents, which only a live run produces",
              file=sys.stderr)
        return 2
    if not args.offline:
        print("greyhound sim: live runs go through `greyhound sim run` with the services; "
              "use --offline here", file=sys.stderr)
        return 2
    out = sys.stdout
    for seconds in run_offline(scenario):
        out.write(f"{seconds:.6f}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
