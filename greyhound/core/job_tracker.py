"""From per-rank iteration times to job-level slowdown and recovery decisions.

Every rank of a synchronous job sees (almost) the same iteration time, so a real fail-slow fires
the detectors of most ranks within an iteration or two, while noise that touches one rank's
measurement fires one. A quorum of ranks therefore decides for the job; the ranks that fired are
kept as a first hint for the analyzer.

All ranks of a job advance together through one batched detector (one vectorised step per
"round", a round taking the next pending value of every rank), which is what lets one tracker
process absorb tens of thousands of rank-iterations per second. A rank that falls behind (paused,
hung, its agent late) does not hold the others back: after ``max_lag`` pending values the round
goes ahead without it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Any

import numpy as np

from greyhound.core.detector import (
    BatchDetector,
    Detection,
    Method,
    batch_from_state,
    batch_state,
    make_batch_detector,
)


@dataclass(frozen=True, slots=True)
class JobDetection:
    kind: str  # "slowdown" | "recovery"
    ranks: tuple[int, ...]
    first_iteration: int
    detected_iteration: int
    before_s: float
    after_s: float


@dataclass
class JobTracker:
    """Per-job detector bank fed with (rank, iteration time) pairs in each rank's order."""

    method: Method = "bocd-v"
    quorum: float = 0.5
    max_lag: int = 8
    slow: bool = False
    index: dict[int, int] = field(default_factory=dict)  # rank -> stream
    _pending: list[deque[float]] = field(default_factory=list)
    _batch: BatchDetector | None = None
    _slow: list[bool] = field(default_factory=list)
    _last: list[Detection | None] = field(default_factory=list)
    updates: int = 0

    def _stream(self, rank: int) -> int:
        s = self.index.get(rank)
        if s is None:
            s = self.index[rank] = len(self._pending)
            self._pending.append(deque())
            self._slow.append(False)
            self._last.append(None)
            # Ranks join at start-up only; a new batch sized for them restarts the warm-up.
            cap = self._batch.streams if self._batch is not None else 0
            if s >= cap:
                self._batch = make_batch_detector(self.method, max(8, 2 * cap, s + 1))
        return s

    def _needed(self) -> int:
        return max(1, int(self.quorum * len(self.index) + 0.999999))

    def observe_many(self, ranks: list[int], durations: list[float]) -> list[JobDetection]:
        for rank, d in zip(ranks, durations, strict=True):
            self._pending[self._stream(rank)].append(d)
        out: list[JobDetection] = []
        while True:
            lens = [len(q) for q in self._pending]
            if not lens or (min(lens) == 0 and max(lens) < self.max_lag):
                break
            assert self._batch is not None
            vec = np.full(self._batch.streams, np.nan)
            for s, q in enumerate(self._pending):
                if q:
                    vec[s] = q.popleft()
            self.updates += int(np.isfinite(vec).sum())
            for s, det in enumerate(self._batch.update_many(vec)):
                if det is not None:
                    decision = self._record(s, det)
                    if decision is not None:
                        out.append(decision)
        return out

    def observe(self, rank: int, duration_s: float) -> JobDetection | None:
        found = self.observe_many([rank], [duration_s])
        return found[-1] if found else None

    def _record(self, stream: int, det: Detection) -> JobDetection | None:
        self._last[stream] = det
        self._slow[stream] = det.kind == "slowdown"
        fired = [r for r, s in self.index.items() if self._slow[s]]
        if not self.slow and len(fired) >= self._needed():
            self.slow = True
            return self._decision("slowdown", fired)
        if self.slow and det.kind == "recovery" and len(fired) < self._needed():
            self.slow = False
            recovered = [r for r, s in self.index.items()
                         if (d := self._last[s]) is not None and d.kind == "recovery"]
            return self._decision("recovery", recovered)
        return None

    def _decision(self, kind: str, ranks: list[int]) -> JobDetection:
        dets = [d for r in ranks if (d := self._last[self.index[r]]) is not None]
        return JobDetection(
            kind=kind, ranks=tuple(sorted(ranks)),
            first_iteration=min(d.index for d in dets),
            detected_iteration=max(d.detected_at for d in dets),
            before_s=float(median(d.before_s for d in dets)),
            after_s=float(median(d.after_s for d in dets)),
        )

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume after a tracker restart (pending values included)."""
        return {
            "method": self.method, "quorum": self.quorum, "max_lag": self.max_lag,
            "slow": self.slow, "index": {str(r): s for r, s in self.index.items()},
            "pending": [list(q) for q in self._pending], "stream_slow": list(self._slow),
            "last": [d.to_json() if d is not None else None for d in self._last],
            "batch": batch_state(self.method, self._batch) if self._batch is not None else None,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> JobTracker:
        t = cls(method=state["method"], quorum=float(state["quorum"]),
                max_lag=int(state["max_lag"]), slow=bool(state["slow"]))
        t.index = {int(r): int(s) for r, s in state["index"].items()}
        t._pending = [deque(q) for q in state["pending"]]
        t._slow = [bool(x) for x in state["stream_slow"]]
        t._last = [Detection(**d) if d is not None else None for d in state["last"]]
        t._batch = batch_from_state(state["batch"]) if state["batch"] is not None else None
        return t
