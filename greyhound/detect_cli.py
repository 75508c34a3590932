"""`greyhound detect [--method bocd-v|bocd|window] [--stage S] PATH...`: offline detection.

Each file holds one iteration time in seconds per line. The series is fed one value at a time to
the same online detector the tracker runs (`make_detector` / `update`), so `detected_at` is the
iteration by which the tracker would have raised the event. Each detection also says which
change it is (`change`: onset, further slowdown while slow, partial or full recovery, or a
suspicion withdrawn), the healthy level it is judged against (`healthy_s`), its `stage` and when
it was first raised (`suspected_at`).

A slowdown is raised in two stages (greyhound.core.levels): ``--stage confirmed`` (the default)
prints each at its confirmation, what may pause a job; ``--stage suspected`` at the moment it was
first raised; ``--stage all`` every decision as made. A scorer that counts every ``slowdown``
line then scores the stage asked for.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import cast

from greyhound.core.detector import METHODS, Detection, Method, make_detector
from greyhound.core.levels import Stage, stage_view
from greyhound.traces.textio import TraceFormatError, read_series

EXIT_BAD_INPUT = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="greyhound detect",
                                description="Detect fail-slows in iteration-time trace files.")
    p.add_argument("--method", choices=METHODS, default="bocd-v",
                   help="BOCD+V (default), plain BOCD, or the sliding-window baseline")
    p.add_argument("--stage", choices=("confirmed", "suspected", "all"), default="confirmed",
                   help="which stage of each slowdown to print (default: confirmed)")
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="text file with one iteration time in seconds per line")
    return p


def run_file(path: str, method: Method) -> list[Detection]:
    detector = make_detector(method)
    out: list[Detection] = []
    for x in read_series(path).tolist():
        det = detector.update(x)
        if det is not None:
            out.append(det)
    return out


def main(argv: Sequence[str]) -> int:
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:  # argparse already printed the usage error
        return EXIT_BAD_INPUT if exc.code else 0
    method = cast(Method, args.method)
    # Read everything first: a bad file must not leave half the output printed.
    results: list[tuple[str, list[Detection]]] = []
    for path in args.paths:
        try:
            results.append((path, run_file(path, method)))
        except TraceFormatError as exc:
            print(f"greyhound detect: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
    for path, dets in results:
        shown = dets if args.stage == "all" else stage_view(dets, cast(Stage, args.stage))
        print(json.dumps({"path": path, "detections": [d.to_json() for d in shown]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
