"""Adaptive hang threshold and a watch over a communicator's completed-operation counter.

A hang is a communicator whose completed count stops advancing for longer than the threshold.
A fixed timeout is either too long for a 20 ms iteration or too short for a checkpoint save, so
the threshold adapts to the job: max(floor, multiple x typical iteration time, margin x the
longest recent pause that ended normally). The last term is what keeps recurring long normal
phases (checkpoint saves, evaluation) from alarming after they have been seen once; the first
such pause longer than both other terms does alarm, which is the price of not knowing the job.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


class HangPolicy:
    """Learns what a normal gap between completed operations looks like for one job."""

    def __init__(self, *, floor_s: float = 60.0, multiple: float = 20.0, margin: float = 1.5,
                 history: int = 256, long_history: int = 8) -> None:
        if floor_s <= 0 or multiple <= 0 or margin < 1.0:
            raise ValueError("floor_s and multiple must be > 0 and margin >= 1")
        self.floor_s = floor_s
        self.multiple = multiple
        self.margin = margin
        self._recent: deque[float] = deque(maxlen=history)
        self._long: deque[float] = deque(maxlen=long_history)

    def observe_iteration(self, duration_s: float) -> None:
        """A completed iteration; a long one (a checkpoint, an evaluation) is remembered."""
        if not duration_s >= 0.0:
            return
        typical = self.typical_s()
        if typical > 0.0 and duration_s > self.multiple * typical:
            self._long.append(duration_s)
        else:
            self._recent.append(duration_s)

    def observe_recovered_pause(self, pause_s: float) -> None:
        """A stall of the completed counter that ended with progress: a normal long phase."""
        if pause_s > 0.0:
            self._long.append(pause_s)

    def typical_s(self) -> float:
        return float(np.median(self._recent)) if self._recent else 0.0

    def threshold_s(self) -> float:
        allowance = self.margin * max(self._long) if self._long else 0.0
        return max(self.floor_s, self.multiple * self.typical_s(), allowance)


@dataclass(frozen=True, slots=True)
class HangAlarm:
    stalled_s: float
    threshold_s: float
    completed: int
    since_s: float


class HangWatch:
    """One communicator's completed counter; alarms once per stall that outlasts the policy."""

    def __init__(self, policy: HangPolicy) -> None:
        self.policy = policy
        self._count: int | None = None
        self._since_s: float | None = None
        self._alarmed = False

    def observe(self, now_s: float, completed_count: int) -> None:
        if self._count is None or completed_count > self._count:
            if self._since_s is not None and self._count is not None:
                pause = now_s - self._since_s
                if self._alarmed or pause > self.policy.multiple * self.policy.typical_s():
                    # It came back: whatever that was, the job survives pauses this long.
                    self.policy.observe_recovered_pause(pause)
            self._count = completed_count
            self._since_s = now_s
            self._alarmed = False

    def check(self, now_s: float) -> HangAlarm | None:
        if self._since_s is None or self._count is None or self._alarmed:
            return None
        stalled = now_s - self._since_s
        threshold = self.policy.threshold_s()
        if stalled <= threshold:
            return None
        self._alarmed = True
        return HangAlarm(stalled, threshold, self._count, self._since_s)
