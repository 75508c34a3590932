"""Ground truth of a labelled iteration-time trace.

A fail-slow episode is a sustained slowdown of at least 12% lasting at least 8 iterations. What a
job also shows but is *not* a fail-slow is kept as labelled noise (spikes, checkpoints, transients
of one or two iterations, steps under 10%), so that a detector firing on it is a false alarm.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True, slots=True)
class Episode:
    """Iterations [start, end) slowed by `factor`; `onset` is the first one >= 10% slow (ramps)."""

    start: int
    end: int
    factor: float
    onset: int

    def to_json(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.end, "factor": self.factor, "onset": self.onset}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Episode:
        start = int(raw["start"])
        return cls(start, int(raw["end"]), float(raw["factor"]), int(raw.get("onset", start)))


@dataclass(frozen=True, slots=True)
class NoiseEvent:
    """A labelled non-fail-slow disturbance (kind, where, how big), for error analysis."""

    kind: str
    start: int
    end: int
    factor: float

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "start": self.start, "end": self.end, "factor": self.factor}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> NoiseEvent:
        return cls(str(raw["kind"]), int(raw["start"]), int(raw["end"]), float(raw["factor"]))


@dataclass(slots=True)
class Trace:
    name: str
    times: npt.NDArray[np.float64]
    episodes: list[Episode] = field(default_factory=list)
    noise: list[NoiseEvent] = field(default_factory=list)

    @property
    def positive(self) -> bool:
        return bool(self.episodes)

    def labels_json(self) -> dict[str, Any]:
        return {"episodes": [e.to_json() for e in self.episodes],
                "noise": [n.to_json() for n in self.noise]}
