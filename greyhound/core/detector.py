"""The detector contract the tracker, the CLI and the evaluation share.

Every method (BOCD+V, plain BOCD, SlidingWindow) is a batch over R streams with `update_many`; a
single-stream `OnlineDetector` is a batch of one, so `greyhound detect`, the tracker and the
report all run the same code. Slowdowns and recoveries are decided by one `LevelState` state
machine so that methods differ only in how they find and validate level changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

Kind = Literal["slowdown", "recovery"]
Method = Literal["bocd-v", "bocd", "window"]
METHODS: tuple[Method, ...] = ("bocd-v", "bocd", "window")

NORMAL = 0
SLOW = 1


Change = Literal["onset", "further", "partial", "full"]


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


class OnlineDetector(Protocol):
    def update(self, x: float) -> Detection | None: ...
    def state_dict(self) -> dict[str, Any]: ...


class BatchDetector(Protocol):
    """R streams (e.g. all ranks of a job) advanced together, one value per stream."""

    streams: int

    def update_many(self, values: npt.ArrayLike) -> list[Detection | None]: ...
    def state_dict(self) -> dict[str, Any]: ...


def make_batch_detector(method: Method = "bocd-v", streams: int = 1,
                        **params: float) -> BatchDetector:
    """Build R streams of one method; params override the method's decision constants."""
    from greyhound.core.bocd import BocdVBatch, BocdVConfig
    from greyhound.core.window import WindowBatch, WindowConfig

    if method in ("bocd-v", "bocd"):
        fields = {k: v for k, v in params.items() if k in BocdVConfig.__slots__}
        _reject_unknown(params, fields)
        for k in ("confirm", "recent", "before", "min_seen", "level_points", "spike_persist",
                  "refine", "persist"):
            if k in fields:
                fields[k] = int(fields[k])
        if "learn" in fields:
            fields["learn"] = bool(fields["learn"])
        config = BocdVConfig(validate=(method == "bocd-v"), **fields)  # type: ignore[arg-type]
        return BocdVBatch(streams, config=config)
    if method == "window":
        wfields = {k: v for k, v in params.items() if k in WindowConfig.__slots__}
        _reject_unknown(params, wfields)
        for k in ("window", "confirm"):
            if k in wfields:
                wfields[k] = int(wfields[k])
        return WindowBatch(streams, config=WindowConfig(**wfields))  # type: ignore[arg-type]
    raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")


def _reject_unknown(params: Mapping[str, float], used: Mapping[str, float]) -> None:
    unknown = sorted(set(params) - set(used))
    if unknown:
        raise ValueError(f"unknown detector parameters: {', '.join(unknown)}")


class SingleStream:
    """An `OnlineDetector` over one stream: a batch of one, so it runs the tracker's code."""

    def __init__(self, method: Method, batch: BatchDetector) -> None:
        self.method = method
        self.batch = batch
        self._buf = np.zeros(1)

    def update(self, x: float) -> Detection | None:
        self._buf[0] = x
        return self.batch.update_many(self._buf)[0]

    def state_dict(self) -> dict[str, Any]:
        return {"method": self.method, "batch": self.batch.state_dict()}


def make_detector(method: Method = "bocd-v", **params: float) -> OnlineDetector:
    return SingleStream(method, make_batch_detector(method, 1, **params))


def batch_from_state(state: Mapping[str, Any]) -> BatchDetector:
    """Rebuild a batch detector saved with `state_dict` (the tracker's restart path)."""
    from greyhound.core.bocd import BocdVBatch
    from greyhound.core.window import WindowBatch

    method = state["method"]
    if method in ("bocd-v", "bocd"):
        return BocdVBatch.from_state(state["batch"])
    if method == "window":
        return WindowBatch.from_state(state["batch"])
    raise ValueError(f"unknown method {method!r} in detector state")


def detector_from_state(state: Mapping[str, Any]) -> OnlineDetector:
    return SingleStream(state["method"], batch_from_state(state))


def batch_state(method: Method, batch: BatchDetector) -> dict[str, Any]:
    """State of a batch detector in the form `batch_from_state` reads."""
    return {"method": method, "batch": batch.state_dict()}


def detect_series(xs: Sequence[float] | npt.NDArray[np.float64],
                  method: Method = "bocd-v") -> list[Detection]:
    det = make_detector(method)
    out: list[Detection] = []
    for x in np.asarray(xs, dtype=np.float64).tolist():
        d = det.update(x)
        if d is not None:
            out.append(d)
    return out


def detect_many(series: Sequence[Sequence[float] | npt.NDArray[np.float64]],
                method: Method = "bocd-v", **params: float) -> list[list[Detection]]:
    """Run many independent series through one batch in lock-step (the evaluation's fast path).

    Shorter series are padded with NaN, which the detectors treat as "no iteration this step";
    results are identical to running each series alone through `detect_series`.
    """
    n = len(series)
    if n == 0:
        return []
    length = max(len(s) for s in series)
    grid = np.full((length, n), np.nan)
    for j, s in enumerate(series):
        grid[: len(s), j] = np.asarray(s, dtype=np.float64)
    batch = make_batch_detector(method, n, **params)
    out: list[list[Detection]] = [[] for _ in range(n)]
    for row in grid:
        for j, d in enumerate(batch.update_many(row)):
            if d is not None:
                out[j].append(d)
    return out
