"""The detector contract the tracker, the CLI and the evaluation share.

Every method (BOCD+V, plain BOCD, SlidingWindow) is a batch over R streams with `update_many`; a
single-stream `OnlineDetector` is a batch of one, so `greyhound detect`, the tracker and the
report all run the same code. Slowdowns and recoveries are decided by one `LevelState` state
machine so that methods differ only in how they find and validate level changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

from greyhound.core.bocd import BocdVBatch, BocdVConfig
from greyhound.core.levels import NORMAL, SLOW, Change, Detection, Kind, LevelState
from greyhound.core.window import WindowBatch, WindowConfig

__all__ = ["METHODS", "NORMAL", "SLOW", "Change", "Detection", "Kind", "LevelState", "Method"]

Method = Literal["bocd-v", "bocd", "window"]
METHODS: tuple[Method, ...] = ("bocd-v", "bocd", "window")


class OnlineDetector(Protocol):
    def update(self, x: float) -> Detection | None: ...
    def state_dict(self) -> dict[str, Any]: ...


class BatchDetector(Protocol):
    """R streams (e.g. all ranks of a job) advanced together, one value per stream."""

    streams: int

    def update_many(self, values: npt.ArrayLike) -> list[Detection | None]: ...
    def restart(self, rows: npt.ArrayLike) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...


def make_batch_detector(method: Method = "bocd-v", streams: int = 1,
                        **params: float) -> BatchDetector:
    """Build R streams of one method; params override the method's decision constants."""

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
