"""Job levels and the decisions about them: the one state machine every detection method shares.

A method (BOCD+V, plain BOCD, SlidingWindow) only finds and validates level changes; whether a
change is a slowdown, a further slowdown, a partial or a full recovery is decided here, so the
methods cannot disagree on it. Kept apart from greyhound.core.detector (which builds the methods)
so that the methods can use it without importing their own factory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

Kind = Literal["slowdown", "recovery"]

NORMAL = 0
SLOW = 1


Change = Literal["onset", "further", "partial", "full"]


def iteration_batch(values: npt.ArrayLike, streams: int
                    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.bool_]]:
    """One iteration time (seconds) per stream, and which of them count: every method's
    ``update_many`` reads its input here, so that all skip the same values (NaN, <= 0)."""
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    if x.shape[0] != streams:
        raise ValueError(f"expected {streams} values, got {x.shape[0]}")
    return x, np.isfinite(x) & (x > 0.0)


@dataclass(frozen=True, slots=True)
class Detection:
    """One online decision: the new level, where it began and when it was raised.

    ``before_s`` is the level the change was measured against (the healthy level for an onset,
    the current slow level for a further slowdown or a recovery) and ``after_s`` the new one.
    ``change`` says which of the four it is: ``onset`` (healthy -> slow), ``further`` (slower
    while slow), ``partial`` (faster but still slow) or ``full`` (back within ``rel`` of the
    healthy level, ``healthy_s``).
    """

    index: int
    detected_at: int
    kind: Kind
    before_s: float
    after_s: float
    change: Change = "onset"
    healthy_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "detected_at": self.detected_at, "kind": self.kind,
                "before_s": self.before_s, "after_s": self.after_s, "change": self.change,
                "healthy_s": self.healthy_s}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Detection:
        return cls(int(raw["index"]), int(raw["detected_at"]), raw["kind"],
                   float(raw["before_s"]), float(raw["after_s"]), raw.get("change", "onset"),
                   float(raw.get("healthy_s", 0.0)))


@dataclass(slots=True)
class LevelState:
    """Per-stream memory of the healthy and the current slow level.

    A slow stream stays open to further changes: a job that slows again (a second fault on top
    of the first) or recovers only partly (one of two causes ended) is reported, each with the
    level before and after, so that the analyzer looks again.
    """

    mode: int = NORMAL
    healthy_s: float = 0.0
    slow_s: float = 0.0

    def judge(self, *, index: int, now: int, before_s: float, after_s: float, rel: float,
              spread: float = 1.0) -> Detection | None:
        """Turn a level change into a decision, or absorb it silently.

        ``before_s`` is the reference the change is measured against; ``spread`` (>= 1) is the
        factor by which the measured ratio may be off (a confidence bound): a rise counts when
        after/before exceeds (1 + rel) * spread, a fall when before/after does.

        Normal mode: a rise is a slowdown (onset); a fall is a new baseline, left to the caller.
        Slow mode: back within rel of the healthy level (by at least rel/2) is a full recovery;
        a rise is a further slowdown, a fall short of the healthy level a partial recovery.
        """
        up = after_s > before_s * (1.0 + rel) * spread
        if self.mode == NORMAL:
            if up:
                self.mode, self.healthy_s, self.slow_s = SLOW, before_s, after_s
                return Detection(index, now, "slowdown", before_s, after_s, "onset", before_s)
            return None
        healthy = self.healthy_s
        if after_s < healthy * (1.0 + rel) and after_s * (1.0 + rel / 2.0) * spread < before_s:
            self.mode, self.slow_s = NORMAL, 0.0
            return Detection(index, now, "recovery", before_s, after_s, "full", healthy)
        if up:
            self.slow_s = after_s
            return Detection(index, now, "slowdown", before_s, after_s, "further", healthy)
        if after_s * (1.0 + rel) * spread < before_s:
            self.slow_s = after_s
            return Detection(index, now, "recovery", before_s, after_s, "partial", healthy)
        return None

    def to_json(self) -> list[float]:
        return [float(self.mode), self.healthy_s, self.slow_s]

    @classmethod
    def from_json(cls, raw: Sequence[float]) -> LevelState:
        return cls(int(raw[0]), float(raw[1]), float(raw[2]))
