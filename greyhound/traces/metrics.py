"""Scores of a detector against labelled traces, in the paper's job-level terms and per episode.

Job level (GREYHOUND Tables 3-4): a job is positive when it holds a fail-slow and predicted
positive when the detector raised any slowdown. Accuracy, FPR = FP / negatives, FNR = FN /
positives. Per episode: an episode is recalled when a slowdown is raised while it lasts (from its
onset to its end plus `grace` iterations, since a short episode may end before the confirming
points are in); latency = detected_at - onset, where onset is the first iteration at least 10%
slow (the start, for an abrupt fail-slow). A slowdown raised outside every episode is a false
alarm, counted in positive jobs too; their rate is per 10,000 iterations outside every episode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from greyhound.core.detector import Detection
from greyhound.traces.labels import Trace


@dataclass(frozen=True, slots=True)
class Scores:
    jobs: int
    positives: int
    accuracy: float
    fpr: float
    fnr: float
    episodes: int
    episode_recall: float
    false_alarms: int
    median_latency: float
    p90_latency: float
    healthy_iterations: int = 0
    fa_per_10k: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def score(traces: Sequence[Trace], detections: Sequence[Sequence[Detection]], *,
          grace: int = 3) -> Scores:
    if len(traces) != len(detections):
        raise ValueError("one detection list per trace")
    tp = fp = tn = fn = 0
    recalled = total = false_alarms = healthy = 0
    latencies: list[int] = []
    for trace, dets in zip(traces, detections, strict=True):
        slow = [d for d in dets if d.kind == "slowdown"]
        predicted = bool(slow)
        if trace.positive:
            tp += predicted
            fn += not predicted
        else:
            fp += predicted
            tn += not predicted
        used: set[int] = set()
        for ep in trace.episodes:
            total += 1
            hits = [i for i, d in enumerate(slow) if ep.onset <= d.detected_at < ep.end + grace]
            if hits:
                recalled += 1
                latencies.append(slow[hits[0]].detected_at - ep.onset)
                used.update(hits)
        # Slowdowns before an onset but inside an episode (a ramp) are not false alarms either.
        inside = {i for i, d in enumerate(slow)
                  for ep in trace.episodes if ep.start <= d.detected_at < ep.end + grace}
        false_alarms += len(set(range(len(slow))) - used - inside)
        n = len(trace.times)
        outside = np.ones(n, dtype=bool)
        for ep in trace.episodes:
            outside[ep.start:min(n, ep.end + grace)] = False
        healthy += int(outside.sum())
    jobs = len(traces)
    positives = tp + fn
    lat = np.asarray(latencies, dtype=np.float64)
    return Scores(
        jobs=jobs, positives=positives,
        accuracy=(tp + tn) / jobs if jobs else float("nan"),
        fpr=fp / (fp + tn) if fp + tn else 0.0,
        fnr=fn / positives if positives else 0.0,
        episodes=total, episode_recall=recalled / total if total else float("nan"),
        false_alarms=false_alarms,
        median_latency=float(np.median(lat)) if lat.size else float("nan"),
        p90_latency=float(np.percentile(lat, 90)) if lat.size else float("nan"),
        healthy_iterations=healthy, fa_per_10k=false_alarms / max(1, healthy) * 1e4,
    )
