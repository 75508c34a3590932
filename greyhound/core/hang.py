"""The adaptive hang threshold: how long a call may stay unfinished before it is a hang.

The job's hang monitor (``job_hangs.JobHangMonitor``) ages each communicator's oldest unfinished
call against it. A fixed timeout is either too long for a 20 ms iteration or too short for a
checkpoint save, so the threshold adapts to the job: max(floor, multiple x typical iteration
time, margin x the longest recent pause that ended normally). The last term is what keeps
recurring long normal phases (checkpoint saves, evaluation) from alarming after they have been
seen once; the first such pause longer than both other terms does alarm, which is the price of
not knowing the job.
"""

from __future__ import annotations

from collections import deque

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
