"""What an incident cost its job in GPU-hours, and what a mitigation saved (pure: the
incident's timeline and the job's size in, numbers out).

A fail-slow job runs at ``healthy / level`` of its healthy rate, where ``level`` is its iteration
time, so ``1 - healthy / level`` of every GPU's time is lost while it lasts. The level is not
constant over an incident: a worsening fault raises it, a plan (or an easing fault) lowers it,
and the tracker records each change as a ``detected`` entry with the levels either side
(``before_s``, ``after_s``). So the loss is the integral of that fraction over the incident,
level by level:

* the healthy level is the first detection's ``before_s`` (for a second fault that opened on
  top of a first, the first's slow level: the second incident counts only its own loss);
* each detection sets the level to its ``after_s`` from when its change began: its first
  changed iteration, (detected - first) iterations of ``after_s`` before it was recorded. A
  detection that another incident opened from (``further``) belongs to that incident's books;
* the incident runs from its onset (the first change, estimated the same way; for a hang, how
  long the communicator had been stalled when the tracker raised it) to its resolution, or to
  now while it is open;
* a hang loses everything: fraction 1.

``lost_fraction`` is the loss over GPUs x duration, so that GPU-hours lost = lost_fraction x
GPUs x duration / 3600 still holds. Reading only the newest detection's ratio, which after a
plan is the speed-up the plan brought (``after_s < before_s``), made a mitigated incident look
free; this is why the levels are kept.

**What a plan saved.** From the first plan taking effect (a ``mitigated`` or ``plan_applied``
entry) until the last one is taken back (``plan_reverted``) or the incident ends, the job would
have gone on at the level in force when the plan arrived: the saving is that counterfactual loss
minus the loss measured over the same span, minus the training time the plans' application cost
(``cost_s`` as the job reported it, every GPU idle meanwhile). It assumes the fault would have
stayed as it was; a fault that eased by itself under the plan is counted as saved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from greyhound.core.incident_kinds import is_hang

PLAN_IN_FORCE = frozenset({"mitigated", "plan_applied"})
PLAN_ENDED = frozenset({"plan_reverted"})


@dataclass(frozen=True)
class TimelinePoint:
    """One entry of the incident's timeline as the cost reads it: a detection's levels either
    side of its change and its iterations (``further``: it opened another incident), or a
    plan's step and what applying it cost."""

    stage: str
    at: datetime
    before_s: float | None = None
    after_s: float | None = None
    first_iteration: int | None = None
    detected_iteration: int | None = None
    further: bool = False
    plan_id: str | None = None
    cost_s: float | None = None


@dataclass(frozen=True)
class Level:
    """The job's iteration time from ``since`` on."""

    since: datetime
    iteration_s: float


@dataclass(frozen=True)
class IncidentCost:
    gpus: int | None
    slowdown: float | None  # the newest level over the healthy one
    peak_slowdown: float | None
    lost_fraction: float | None  # the loss over GPUs x duration
    onset_at: datetime
    end_at: datetime
    ongoing: bool
    duration_s: float
    detection_latency_s: float | None
    gpu_hours_lost: float | None
    mitigated_at: datetime | None  # when the first plan took effect
    gpu_hours_saved: float | None  # None: no plan took effect (or the size is unknown)


def detections(timeline: Sequence[TimelinePoint]) -> list[TimelinePoint]:
    """The incident's own detections (not a further fault's), oldest first."""
    found = [p for p in timeline if p.stage == "detected" and (p.after_s or 0) > 0
             and not p.further]
    return sorted(found, key=lambda p: p.at)


def change_began(p: TimelinePoint) -> datetime:
    """When the change a detection reports began: its first changed iteration, (detected -
    first) iterations of the new level before the detection was recorded."""
    after = p.after_s or 0.0
    f, d = p.first_iteration, p.detected_iteration
    if f is None or d is None or f < 0 or d < f:
        return p.at
    return p.at - timedelta(seconds=(d - f) * after)


def onset(kind: str, first: TimelinePoint) -> datetime:
    """When the problem began, estimated back from its first detection."""
    if is_hang(kind):
        return first.at - timedelta(seconds=max(first.after_s or 0.0, 0.0))
    return change_began(first)


def levels(found: Sequence[TimelinePoint], start: datetime) -> list[Level]:
    """The job's level over the incident: the first detection's from ``start``, each later one
    from when its change began (never before the level it follows)."""
    out: list[Level] = []
    for i, p in enumerate(found):
        since = start if i == 0 else max(change_began(p), out[-1].since)
        out.append(Level(since, float(p.after_s or 0.0)))
    return out


def lost_fraction_at(level_s: float, healthy_s: float) -> float:
    return max(0.0, 1.0 - healthy_s / level_s) if level_s > 0 else 0.0


def lost_seconds(steps: Sequence[Level], healthy_s: float, t0: datetime, t1: datetime) -> float:
    """Seconds of every GPU's time lost between ``t0`` and ``t1`` (the integral of the lost
    fraction over the levels)."""
    total = 0.0
    for i, step in enumerate(steps):
        lo = max(step.since, t0)
        hi = min(steps[i + 1].since if i + 1 < len(steps) else t1, t1)
        if hi > lo:
            total += lost_fraction_at(step.iteration_s, healthy_s) * (hi - lo).total_seconds()
    return total


def _plan_span(timeline: Sequence[TimelinePoint], end: datetime
               ) -> tuple[datetime, datetime, float] | None:
    """From the first plan taking effect to the last one's end, and what applying them cost."""
    applied = sorted((p for p in timeline if p.stage in PLAN_IN_FORCE), key=lambda p: p.at)
    if not applied:
        return None
    ends: dict[str, datetime] = {}
    for p in timeline:
        if p.stage in PLAN_ENDED and p.plan_id is not None:
            ends[p.plan_id] = min(p.at, ends.get(p.plan_id, p.at))
    last = max(min(ends.get(str(p.plan_id), end), end) for p in applied)
    cost = sum(max(p.cost_s or 0.0, 0.0) for p in applied)
    return applied[0].at, last, cost


def incident_cost(*, kind: str, opened_at: datetime, resolved_at: datetime | None,
                  timeline: Sequence[TimelinePoint], gpus: int | None,
                  now: datetime) -> IncidentCost:
    found = detections(timeline)
    start = min(onset(kind, found[0]), opened_at) if found else opened_at
    end = resolved_at or now
    duration = max((end - start).total_seconds(), 0.0)
    latency = (found[0].at - start).total_seconds() if found else None
    span = _plan_span(timeline, end)
    slowdown = peak = fraction = saved = None
    lost_s: float | None = None
    healthy = found[0].before_s if found else None
    if is_hang(kind):
        fraction, lost_s = 1.0, duration
    elif found and healthy is not None and healthy > 0:
        steps = levels(found, start)
        slowdown = steps[-1].iteration_s / healthy
        peak = max(s.iteration_s for s in steps) / healthy
        lost_s = lost_seconds(steps, healthy, start, end)
        fraction = (lost_s / duration if duration > 0
                    else lost_fraction_at(steps[0].iteration_s, healthy))
        if span is not None and gpus:
            t0, t1, cost_s = span
            before = [p for p in found if p.at <= t0] or found[:1]
            would_s = (lost_fraction_at(float(before[-1].after_s or 0.0), healthy)
                       * max((t1 - t0).total_seconds(), 0.0))
            saved = (would_s - lost_seconds(steps, healthy, t0, t1) - cost_s) * gpus / 3600.0
    hours = None if lost_s is None or not gpus else lost_s * gpus / 3600.0
    return IncidentCost(gpus=gpus, slowdown=slowdown, peak_slowdown=peak, lost_fraction=fraction,
                        onset_at=start, end_at=end, ongoing=resolved_at is None,
                        duration_s=duration, detection_latency_s=latency, gpu_hours_lost=hours,
                        mitigated_at=span[0] if span else None, gpu_hours_saved=saved)


def localization_latency_s(timeline: Sequence[TimelinePoint], opened_at: datetime) -> float | None:
    """Seconds from the incident's opening to its first localisation (0 for a hang named at once)."""
    for p in timeline:
        if p.stage == "localized":
            return max((p.at - opened_at).total_seconds(), 0.0)
    return None

