"""Job levels and the decisions about them: the one state machine every detection method shares.

A method (BOCD+V, plain BOCD, SlidingWindow) only finds and validates level changes; whether a
change is a slowdown, a further slowdown, a partial or a full recovery is decided here, so the
methods cannot disagree on it. Kept apart from greyhound.core.detector (which builds the methods)
so that the methods can use it without importing their own factory.

Two stages. A slowdown raised on fewer points than ``hold`` is one a short transient can explain
(a fail-slow lasts at least 8 iterations; contention bursts, evaluation steps and stalls of 3-5
iterations look like one for as long as they last): it is *suspected*, and the method confirms it
once it has held ``hold`` points from its start, or the state withdraws it when the level comes
back first. A slowdown raised on ``hold`` points or more is confirmed at once. What a suspicion
may cost is the consumer's to decide (profiling may start, a pause may not).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

Kind = Literal["slowdown", "recovery"]

NORMAL = 0
SLOW = 1


Change = Literal["onset", "further", "partial", "full", "withdrawn"]
Stage = Literal["suspected", "confirmed"]


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
    ``change`` says which it is: ``onset`` (healthy -> slow), ``further`` (slower while slow),
    ``partial`` (faster but still slow), ``full`` (back within ``rel`` of the healthy level,
    ``healthy_s``) or ``withdrawn`` (a suspected slowdown the level came back from before it
    was confirmed).

    A slowdown's ``stage`` is ``suspected`` or ``confirmed``; ``suspected_at`` is the iteration
    it was first raised at, so a confirmation of an earlier suspicion (``detected_at`` later)
    says both moments. Recoveries are confirmed as they are made.
    """

    index: int
    detected_at: int
    kind: Kind
    before_s: float
    after_s: float
    change: Change = "onset"
    healthy_s: float = 0.0
    stage: Stage = "confirmed"
    suspected_at: int = -1

    @property
    def raised_at(self) -> int:
        """When this decision was first raised: its suspicion, or itself."""
        return self.suspected_at if self.suspected_at >= 0 else self.detected_at

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "detected_at": self.detected_at, "kind": self.kind,
                "before_s": self.before_s, "after_s": self.after_s, "change": self.change,
                "healthy_s": self.healthy_s, "stage": self.stage,
                "suspected_at": self.raised_at}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Detection:
        """Either form: one without a stage (saved before there were two) is confirmed."""
        return cls(int(raw["index"]), int(raw["detected_at"]), raw["kind"],
                   float(raw["before_s"]), float(raw["after_s"]), raw.get("change", "onset"),
                   float(raw.get("healthy_s", 0.0)), raw.get("stage", "confirmed"),
                   int(raw.get("suspected_at", -1)))


def stage_view(detections: Sequence[Detection], stage: Stage) -> list[Detection]:
    """The decisions as one stage sees them, each slowdown once: ``confirmed``, at its
    confirmation (suspicions and withdrawals left out); ``suspected``, at the moment it was
    first raised (the later confirmation of a suspicion left out). Recoveries in both."""
    out: list[Detection] = []
    for d in detections:
        if d.kind == "slowdown":
            first = d.stage == "suspected" or d.raised_at == d.detected_at
            if first if stage == "suspected" else d.stage == "confirmed":
                out.append(d)
        elif d.change != "withdrawn":
            out.append(d)
    return out


@dataclass(slots=True)
class LevelState:
    """Per-stream memory of the healthy and the current slow level, and of a pending suspicion.

    A slow stream stays open to further changes: a job that slows again (a second fault on top
    of the first) or recovers only partly (one of two causes ended) is reported, each with the
    level before and after, so that the analyzer looks again.

    At most one suspicion is pending per stream (``pending`` is its start, -1 when none). While
    it is, the level may move on without new reports: a further rise or a partial fall is the
    same suspected slowdown, confirmed at whatever level it holds; a return to the level before
    it withdraws it.
    """

    mode: int = NORMAL
    healthy_s: float = 0.0
    slow_s: float = 0.0
    pending: int = -1
    pending_at: int = -1
    pending_before_s: float = 0.0
    pending_change: Change = "onset"

    def judge(self, *, index: int, now: int, before_s: float, after_s: float, rel: float,
              spread: float = 1.0, hold: int = 0, points: int | None = None
              ) -> Detection | None:
        """Turn a level change into a decision, or absorb it silently.

        ``before_s`` is the reference the change is measured against; ``spread`` (>= 1) is the
        factor by which the measured ratio may be off (a confidence bound): a rise counts when
        after/before exceeds (1 + rel) * spread, a fall when before/after does. A slowdown
        found on fewer than ``hold`` points is suspected (see the module): ``points``, the
        points at the new level it rests on, by default every point since ``index`` (a method
        that leaves spikes out of the evidence counts without them: an evaluation step before
        a 4-iteration burst does not make it a 5-iteration level).

        Normal mode: a rise is a slowdown (onset); a fall is a new baseline, left to the caller.
        Slow mode: back within rel of the healthy level (by at least rel/2) is a full recovery;
        a rise is a further slowdown, a fall short of the healthy level a partial recovery.
        While a suspicion is pending, every change is absorbed into it: the stream stays slow
        at the new level until the method confirms or withdraws it.
        """
        pending = self.pending >= 0
        det = self._level(index, now, before_s, after_s, rel, spread)
        if det is None:
            return None
        if pending:
            self.mode, self.slow_s = SLOW, after_s
            return None
        if det.kind == "slowdown" and (now - index + 1 if points is None else points) < hold:
            self.pending, self.pending_at = index, now
            self.pending_before_s, self.pending_change = before_s, det.change
            return replace(det, stage="suspected", suspected_at=now)
        return replace(det, suspected_at=now) if det.kind == "slowdown" else det

    def confirm(self, now: int, after_s: float) -> Detection:
        """The pending suspicion has held: its confirmation at ``now``, at level ``after_s``."""
        det = Detection(self.pending, now, "slowdown", self.pending_before_s, after_s,
                        self.pending_change, self.healthy_s, "confirmed", self.pending_at)
        self.pending, self.pending_at = -1, -1
        return det

    def withdraw(self, now: int, after_s: float) -> Detection:
        """The level came back before the pending suspicion held: the stream is where it was
        before it (healthy, or slow at the earlier level), and the suspicion is withdrawn."""
        det = Detection(self.pending, now, "recovery", self.slow_s, after_s, "withdrawn",
                        self.healthy_s)
        if self.pending_change == "onset":
            self.mode, self.slow_s = NORMAL, 0.0
        else:
            self.slow_s = self.pending_before_s
        self.pending, self.pending_at = -1, -1
        return det

    def _level(self, index: int, now: int, before_s: float, after_s: float, rel: float,
               spread: float) -> Detection | None:
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
        return [float(self.mode), self.healthy_s, self.slow_s, float(self.pending),
                float(self.pending_at), self.pending_before_s,
                float(self.pending_change == "further")]

    @classmethod
    def from_json(cls, raw: Sequence[float]) -> LevelState:
        """Either form: three numbers (saved before suspicions) or seven."""
        out = cls(int(raw[0]), float(raw[1]), float(raw[2]))
        if len(raw) >= 7:
            out.pending, out.pending_at = int(raw[3]), int(raw[4])
            out.pending_before_s = float(raw[5])
            out.pending_change = "further" if raw[6] else "onset"
        return out
