"""SlidingWindow, the paper's simplest baseline: 10% off the window median.

A slowdown is raised when the median of the last `confirm` iterations is more than `rel` above
the median of the `window` iterations before them; the recovery when that short median is back
within `rel` of the healthy level. Batched over streams like BOCD+V so the evaluation can run
both over the same traces at the same cost.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from greyhound.core.levels import SLOW, Detection, LevelState, iteration_batch


@dataclass(frozen=True, slots=True)
class WindowConfig:
    window: int = 32
    confirm: int = 3
    rel: float = 0.10


class WindowBatch:
    """Window-median detector for R streams; each stream keeps its last window+confirm values."""

    def __init__(self, streams: int, *, config: WindowConfig | None = None) -> None:
        self.config = config or WindowConfig()
        c = self.config
        if c.window < 1 or c.confirm < 1:
            raise ValueError("window and confirm must be >= 1")
        self.streams = streams
        self.span = c.window + c.confirm
        self.buf = np.full((streams, self.span), np.nan)
        self.seen = np.zeros(streams, dtype=np.int64)
        self.states = [LevelState() for _ in range(streams)]

    def update_many(self, values: npt.ArrayLike) -> list[Detection | None]:
        x, ok = iteration_batch(values, self.streams)
        out: list[Detection | None] = [None] * self.streams
        rows = np.flatnonzero(ok)
        if rows.size == 0:
            return out
        c = self.config
        if rows.size == self.streams:
            self.buf[:, :-1] = self.buf[:, 1:]
            self.buf[:, -1] = x
            buf = self.buf
        else:
            buf = self.buf[rows]
            buf[:, :-1] = buf[:, 1:]
            buf[:, -1] = x[rows]
            self.buf[rows] = buf
        self.seen[rows] += 1
        full = self.seen[rows] >= self.span
        if not full.any():
            return out
        recent = np.median(buf[:, c.window:], axis=1)
        base = np.median(buf[:, : c.window], axis=1)
        hit = full & ((recent > base * (1.0 + c.rel)) | (recent * (1.0 + c.rel) < base))
        for j in np.flatnonzero(hit):
            row = int(rows[j])
            state = self.states[row]
            now = int(self.seen[row] - 1)
            ref = state.slow_s if state.mode == SLOW else float(base[j])
            out[row] = state.judge(index=now - c.confirm + 1, now=now, before_s=ref,
                                   after_s=float(recent[j]), rel=c.rel)
        return out

    def restart(self, rows: npt.ArrayLike) -> None:
        """Streams whose source started over: their window fills again before they decide
        (what they decided stays)."""
        r = np.asarray(rows, dtype=np.intp).reshape(-1)
        self.buf[r] = np.nan
        self.seen[r] = 0

    def state_dict(self) -> dict[str, Any]:
        c = self.config
        return {"config": {"window": c.window, "confirm": c.confirm, "rel": c.rel},
                "buf": [[v if np.isfinite(v) else None for v in row] for row in self.buf.tolist()],
                "seen": self.seen.tolist(), "states": [s.to_json() for s in self.states]}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> WindowBatch:
        raw = state["config"]
        config = WindowConfig(window=int(raw["window"]), confirm=int(raw["confirm"]),
                              rel=float(raw["rel"]))
        seen = np.asarray(state["seen"], dtype=np.int64)
        out = cls(seen.shape[0], config=config)
        out.buf = np.array([[np.nan if v is None else v for v in row] for row in state["buf"]],
                           dtype=np.float64).reshape(seen.shape[0], out.span)
        out.seen = seen
        out.states = [LevelState.from_json(s) for s in state["states"]]
        return out
