"""What an incident cost the job in GPU-hours (pure: timeline and job size in, numbers out).

GPU-hours lost = lost fraction x the job's GPUs x how long the problem lasted, where

* the lost fraction of a fail-slow is 1 - before/after: the tracker measured the job's
  iteration time before (``before_s``) and after (``after_s``) the change, so the job made
  progress at before/after of its healthy rate, and the rest of every GPU's time was wasted. The
  newest detection of the incident gives the ratio (a worsening fault updates it). A hang loses
  everything: fraction 1.
* the GPUs are the job's world size from the agents' hellos (else the ranks the API knows).
* the duration runs from the onset to the resolution (or now, while open). The onset comes
  before the detection: for a slowdown it is the first slow iteration, (detected - first)
  iterations of ``after_s`` each before the detection; for a hang, ``after_s`` is how long the
  communicator had been stalled when the tracker raised it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any


@dataclass(frozen=True)
class TimelinePoint:
    stage: str
    at: datetime
    detail: Mapping[str, Any]


@dataclass(frozen=True)
class IncidentCost:
    gpus: int | None
    slowdown: float | None
    lost_fraction: float | None
    onset_at: datetime
    end_at: datetime
    ongoing: bool
    duration_s: float
    detection_latency_s: float | None
    gpu_hours_lost: float | None


def is_hang(kind: str) -> bool:
    return kind.startswith("hang")


def _num(detail: Mapping[str, Any], key: str) -> float | None:
    v = detail.get(key)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _detections(timeline: Sequence[TimelinePoint]) -> list[TimelinePoint]:
    return [p for p in timeline if p.stage == "detected" and "after_s" in p.detail]


def onset(kind: str, first: TimelinePoint) -> datetime:
    """When the problem began, estimated back from its first detection."""
    after = _num(first.detail, "after_s") or 0.0
    if is_hang(kind):
        return first.at - timedelta(seconds=max(after, 0.0))
    f, d = _num(first.detail, "first_iteration"), _num(first.detail, "detected_iteration")
    if f is None or d is None or f < 0 or d < f:
        return first.at
    return first.at - timedelta(seconds=(d - f) * after)


def incident_cost(*, kind: str, opened_at: datetime, resolved_at: datetime | None,
                  timeline: Sequence[TimelinePoint], gpus: int | None,
                  now: datetime) -> IncidentCost:
    found = _detections(timeline)
    start = min(onset(kind, found[0]), opened_at) if found else opened_at
    end = resolved_at or now
    duration = max((end - start).total_seconds(), 0.0)
    latency = (found[0].at - start).total_seconds() if found else None
    slowdown: float | None = None
    fraction: float | None
    if is_hang(kind):
        fraction = 1.0
    else:
        fraction = None
        if found:
            before, after = _num(found[-1].detail, "before_s"), _num(found[-1].detail, "after_s")
            if before and after and before > 0:
                slowdown = after / before
                fraction = max(0.0, 1.0 - before / after)
    hours = None if fraction is None or not gpus else fraction * gpus * duration / 3600.0
    return IncidentCost(gpus=gpus, slowdown=slowdown, lost_fraction=fraction, onset_at=start,
                        end_at=end, ongoing=resolved_at is None, duration_s=duration,
                        detection_latency_s=latency, gpu_hours_lost=hours)


def localization_latency_s(timeline: Sequence[TimelinePoint], opened_at: datetime) -> float | None:
    """Seconds from the incident's opening to its first localisation (0 for a hang named at once)."""
    for p in timeline:
        if p.stage == "localized":
            return max((p.at - opened_at).total_seconds(), 0.0)
    return None


def validation_pause_s(evidence: Mapping[str, Any]) -> float | None:
    """How long the validator held the job paused for its checks, when it ran them."""
    v = evidence.get("validation")
    if isinstance(v, Mapping):
        pause = _num(v, "pause_s")
        return pause if pause is not None and pause > 0 else None
    return None
