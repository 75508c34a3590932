#!/usr/bin/env python3
"""BOCD+V's errors on one generator seed, one by one: each false alarm on a healthy job and each
missed episode, with the labelled noise around it and the series there, and a count of the
noise kinds behind them. The error analysis docs/detection.md reports, made repeatable.

    .venv/bin/python scripts/detect_errors.py hostile 7
    .venv/bin/python scripts/detect_errors.py realistic 6 --show 5

Hostile traces are scored per job (a healthy job with any slowdown is a false alarm);
realistic ones per event, as scripts/detect_report.py scores them (an episode missed when no
slowdown is raised within its slack, greyhound.traces.events).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from greyhound.core.detector import Detection, detect_many  # noqa: E402
from greyhound.core.levels import Stage, stage_view  # noqa: E402
from greyhound.traces.events import judge_trace  # noqa: E402
from greyhound.traces.generator import generate_traces  # noqa: E402
from greyhound.traces.labels import NoiseEvent, Trace  # noqa: E402
from greyhound.traces.realistic import generate_realistic_traces  # noqa: E402

AROUND = 40  # iterations before an error whose noise events are named


def _near(trace: Trace, at: int) -> list[NoiseEvent]:
    return [n for n in trace.noise if n.kind not in ("warmup", "gc")
            and n.start <= at + 3 and n.end >= at - AROUND]


def _series(trace: Trace, at: int) -> str:
    x = trace.times / float(np.median(trace.times[max(0, at - 60):max(1, at)]))
    return " ".join(f"{v:.2f}" for v in x[max(0, at - 6):at + 18])


def _line(trace: Trace, what: str, at: int, extra: str) -> list[str]:
    noise = ", ".join(f"{n.kind} [{n.start},{n.end}) x{n.factor:.2f}" for n in _near(trace, at))
    return [f"{trace.name} {what} at {at}{extra}; noise: {noise or 'none'}",
            f"    {_series(trace, at)}"]


def errors(traces: Sequence[Trace], dets: Sequence[Sequence[Detection]], stage: Stage,
           events: bool) -> tuple[list[list[str]], Counter[tuple[str, ...]]]:
    """Each error's lines, and how many errors each set of nearby noise kinds explains."""
    out: list[list[str]] = []
    kinds: Counter[tuple[str, ...]] = Counter()
    for t, d in zip(traces, dets, strict=True):
        view = stage_view(d, stage)
        slows = [x for x in view if x.kind == "slowdown"]
        if events:
            for e, late in zip(t.episodes, judge_trace(t, view).latencies, strict=True):
                if late is None:
                    out.append(_line(t, f"missed {e.factor:.2f}x [{e.start},{e.end})", e.start,
                                     ""))
                    kinds[tuple(sorted({n.kind for n in _near(t, e.start)}))] += 1
        elif not t.episodes and slows:
            x = slows[0]
            out.append(_line(t, "false alarm", x.index,
                             f" (raised {x.detected_at}, {x.after_s / x.before_s:.3f}x)"))
            kinds[tuple(sorted({n.kind for n in _near(t, x.index)}))] += 1
    return out, kinds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("generator", choices=("hostile", "realistic"))
    ap.add_argument("seed", type=int)
    ap.add_argument("--count", type=int, default=400)
    ap.add_argument("--stage", choices=("confirmed", "suspected"), default="confirmed")
    ap.add_argument("--show", type=int, default=20, help="errors printed in full")
    a = ap.parse_args()
    make = generate_traces if a.generator == "hostile" else generate_realistic_traces
    traces = make(a.count, a.seed)
    dets = detect_many([t.times for t in traces], "bocd-v")
    found, kinds = errors(traces, dets, a.stage, events=a.generator == "realistic")
    what = "missed episodes" if a.generator == "realistic" else "false alarms"
    print(f"{a.generator} seed {a.seed}, {len(traces)} traces, {a.stage}: {len(found)} {what}")
    for lines in found[:a.show]:
        print("\n".join(lines))
    print("noise around them:")
    for k, n in kinds.most_common():
        print(f"  {n:>4}  {', '.join(k) or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
