"""Event-level scores on traces labelled by hindsight: recall, latency, false alarms per 10k.

The rules are those the recorded traces are judged by, so that the realistic generator's traces
and the recorded ones are scored alike in one process (and in tests) without a subprocess per
file. An episode is found when a slowdown has its ``index`` in ``[start - tolerance, start + 10]``
and was raised by ``start + 15``; latency is ``detected_at - start`` (0 when earlier). A slowdown
whose index lies outside every episode (widened by the tolerance before and 5 iterations after)
and every ignored stretch is a false alarm; the rate is per 10,000 iterations outside those.
Job level, as the recorded traces' scorer counts it: a trace with episodes is a true positive
when one of them is found, a trace without one a false positive when it has a false alarm.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from greyhound.core.detector import Detection
from greyhound.traces.labels import Trace

#: How late a detection's estimated onset and the detection itself may be.
INDEX_SLACK = 10
DETECT_SLACK = 15
AFTER_EPISODE = 5


@dataclass(frozen=True, slots=True)
class EventScores:
    traces: int
    episodes: int
    found: int
    recall: float
    median_latency: float
    p90_latency: float
    false_alarms: int
    healthy_iterations: int
    fa_per_10k: float
    accuracy: float = float("nan")
    fpr: float = 0.0
    fnr: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class TraceOutcome:
    """What one trace contributed: per episode the latency (None: missed), and the alarms."""

    latencies: list[int | None]
    false_alarms: list[Detection]
    healthy_iterations: int


def judge_trace(trace: Trace, detections: Sequence[Detection]) -> TraceOutcome:
    n = len(trace.times)
    slow = [d for d in detections if d.kind == "slowdown"]
    tol = trace.onset_tolerance
    covered = np.zeros(n, dtype=bool)
    for a, b in trace.ignore:
        covered[max(0, a):min(n, b)] = True
    latencies: list[int | None] = []
    for ep in trace.episodes:
        on = ep.start
        covered[max(0, on - tol):min(n, ep.end + AFTER_EPISODE)] = True
        hits = [d for d in slow
                if on - tol <= d.index <= on + INDEX_SLACK and d.detected_at <= on + DETECT_SLACK]
        latencies.append(max(0, min(d.detected_at for d in hits) - on) if hits else None)
    alarms = [d for d in slow if not covered[min(max(d.index, 0), n - 1)]] if n else []
    return TraceOutcome(latencies, alarms, int((~covered).sum()))


def score_events(traces: Sequence[Trace],
                 detections: Sequence[Sequence[Detection]]) -> EventScores:
    if len(traces) != len(detections):
        raise ValueError("one detection list per trace")
    outcomes = [judge_trace(t, d) for t, d in zip(traces, detections, strict=True)]
    lat = [x for o in outcomes for x in o.latencies if x is not None]
    episodes = sum(len(o.latencies) for o in outcomes)
    alarms = sum(len(o.false_alarms) for o in outcomes)
    healthy = sum(o.healthy_iterations for o in outcomes)
    arr = np.asarray(lat, dtype=np.float64)
    pos = [o for o in outcomes if o.latencies]
    neg = [o for o in outcomes if not o.latencies]
    fn = sum(all(x is None for x in o.latencies) for o in pos)
    fp = sum(bool(o.false_alarms) for o in neg)
    return EventScores(
        traces=len(traces), episodes=episodes, found=len(lat),
        recall=len(lat) / episodes if episodes else float("nan"),
        median_latency=float(np.median(arr)) if arr.size else float("nan"),
        p90_latency=float(np.percentile(arr, 90)) if arr.size else float("nan"),
        false_alarms=alarms, healthy_iterations=healthy,
        fa_per_10k=alarms / max(1, healthy) * 1e4,
        accuracy=(len(outcomes) - fn - fp) / len(outcomes) if outcomes else float("nan"),
        fpr=fp / len(neg) if neg else 0.0, fnr=fn / len(pos) if pos else 0.0)
