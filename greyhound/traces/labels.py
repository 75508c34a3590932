"""Ground truth of a labelled iteration-time trace.

A fail-slow episode is a sustained slowdown of at least 12% lasting at least 8 iterations. What a
job also shows but is *not* a fail-slow is kept as labelled noise (spikes, checkpoints, transients
of one or two iterations, steps under 10%), so that a detector firing on it is a false alarm.

Traces labelled by hindsight (recorded ones, and the realistic generator's) also carry `ignore`
stretches, neither to be found nor to be avoided (warm-up, slow runs too short to be episodes,
levels too close to the 10% threshold to demand either way), the healthy iteration time `t0` and
an `onset_tolerance`: the centred medians that place such onsets are only accurate to a few
iterations, so a detection may precede the labelled start by that much.
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
    ignore: list[tuple[int, int]] = field(default_factory=list)
    t0: float | None = None
    onset_tolerance: int = 0

    @property
    def positive(self) -> bool:
        return bool(self.episodes)

    def labels_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"episodes": [e.to_json() for e in self.episodes],
                               "noise": [n.to_json() for n in self.noise]}
        if self.ignore:
            out["ignore"] = [list(span) for span in self.ignore]
        if self.t0 is not None:
            out["t0"] = self.t0
            out["onset_tolerance"] = self.onset_tolerance
        return out

    @classmethod
    def from_labels(cls, name: str, times: npt.NDArray[np.float64],
                    raw: dict[str, Any]) -> Trace:
        """Either label layout: ours (episodes as objects) or the recorded traces' one
        (episodes as ``[start, end, factor]``, ``ignore`` spans, ``t0``)."""
        episodes = [Episode.from_json(e) if isinstance(e, dict)
                    else Episode(int(e[0]), int(e[1]), float(e[2]), int(e[0]))
                    for e in raw.get("episodes", [])]
        t0 = raw.get("t0")
        return cls(name, times, episodes,
                   [NoiseEvent.from_json(n) for n in raw.get("noise", [])],
                   [(int(a), int(b)) for a, b in raw.get("ignore", [])],
                   float(t0) if t0 is not None else None, int(raw.get("onset_tolerance", 0)))
