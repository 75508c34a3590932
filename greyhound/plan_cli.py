"""``greyhound plan microbatch --times T1,T2,... --microbatches M [--multiple-of P]``.

Prints the S2 allocation as one JSON object, ``{"allocation": [...], "makespan": X}``, so a
script or an operator can try a plan before the planner service exists. Bad input is a message
on stderr and exit status 2, as argparse does for its own errors.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from greyhound.core.microbatch import allocate_microbatches


def _times(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",")] if text.strip() else []
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected comma-separated seconds per micro-batch, e.g. 1.0,1.5,1.0"
        ) from None


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="greyhound plan", description="mitigation plans, offline")
    sub = parser.add_subparsers(dest="command", required=True)
    mb = sub.add_parser("microbatch", help="S2: micro-batches per DP group minimising the slowest")
    mb.add_argument("--times", type=_times, required=True,
                    help="seconds per micro-batch of each DP group, comma-separated")
    mb.add_argument("--microbatches", type=int, required=True, help="M, micro-batches per iteration")
    mb.add_argument("--multiple-of", type=int, default=1,
                    help="every group's count a multiple of P (e.g. the pipeline depth)")
    args = parser.parse_args(list(argv))
    try:
        plan = allocate_microbatches(args.times, args.microbatches, multiple_of=args.multiple_of)
    except ValueError as exc:
        print(f"greyhound plan microbatch: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan.as_dict()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
