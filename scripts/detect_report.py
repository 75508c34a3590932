#!/usr/bin/env python3
"""Detection report: BOCD+V against the paper's baselines on labelled traces.

Generates the seeded synthetic set (and/or loads directories of recorded traces written by
`greyhound.traces.textio.write_traces`), runs the three methods through the same batched code the
tracker uses, and prints the paper's job-level accuracy / FPR / FNR with episode recall and
detection latency. The last line is `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from greyhound.core.detector import METHODS, detect_many
from greyhound.traces.generator import generate_traces
from greyhound.traces.labels import Trace
from greyhound.traces.metrics import Scores, score
from greyhound.traces.textio import load_traces

TARGETS = {"accuracy": 0.995, "fpr": 0.005, "fnr": 0.01, "median_latency": 3.0}


def _row(name: str, s: Scores, seconds: float) -> str:
    return (f"{name:<8} {s.accuracy * 100:8.2f}% {s.fpr * 100:7.2f}% {s.fnr * 100:7.2f}% "
            f"{s.episode_recall * 100:8.2f}% {s.false_alarms:6d} {s.median_latency:7.1f} "
            f"{s.p90_latency:6.1f} {seconds:7.1f}s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=400, help="synthetic traces (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--traces", action="append", default=[], metavar="DIR",
                    help="also evaluate the labelled traces in DIR (repeatable)")
    args = ap.parse_args()
    traces: list[Trace] = generate_traces(args.count, args.seed) if args.count else []
    for d in args.traces:
        traces.extend(load_traces(d))
    if not traces:
        print("no traces", file=sys.stderr)
        return 2
    pos = sum(t.positive for t in traces)
    iters = sum(len(t.times) for t in traces)
    print(f"{len(traces)} traces ({pos} with fail-slows, {len(traces) - pos} healthy), "
          f"{iters} iterations, {sum(len(t.episodes) for t in traces)} episodes")
    print(f"{'method':<8} {'accuracy':>9} {'FPR':>8} {'FNR':>8} {'ep.recall':>9} {'f.alarm':>6} "
          f"{'med.lat':>7} {'p90lat':>6} {'time':>8}")
    result: dict[str, object] = {"traces": len(traces), "positives": pos, "iterations": iters}
    ok = True
    for method in METHODS:
        t0 = time.perf_counter()
        dets = detect_many([t.times for t in traces], method)
        s = score(traces, dets)
        print(_row(method, s, time.perf_counter() - t0), flush=True)
        result[method] = s.to_json()
        if method == "bocd-v":
            ok = (s.accuracy >= TARGETS["accuracy"] and s.fpr <= TARGETS["fpr"]
                  and s.fnr <= TARGETS["fnr"] and s.median_latency <= TARGETS["median_latency"])
    print("latency = detected_at - onset (first iteration >= 10% slow), in iterations")
    print(f"BOCD+V targets (accuracy >= 99.5%, FPR <= 0.5%, FNR <= 1%, median latency <= 3): "
          f"{'met' if ok else 'NOT met'}")
    result["targets_met"] = ok
    print("RESULT " + json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
