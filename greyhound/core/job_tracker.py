"""From per-rank detections to job-level slowdown and recovery decisions.

Every rank of a synchronous job sees (almost) the same iteration time, so a real fail-slow fires
the detectors of most ranks within an iteration or two, while noise that touches one rank's
measurement fires one. A quorum of ranks therefore decides for the job; the ranks that fired are
kept as a first hint for the analyzer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median
from typing import Any

from greyhound.core.detector import Detection, Method, OnlineDetector, detector_from_state, make_detector


@dataclass(frozen=True, slots=True)
class JobDetection:
    kind: str  # "slowdown" | "recovery"
    ranks: tuple[int, ...]
    first_iteration: int
    detected_iteration: int
    before_s: float
    after_s: float


@dataclass
class _RankState:
    detector: OnlineDetector
    slow: bool = False
    last: Detection | None = None
    iterations: int = 0


@dataclass
class JobTracker:
    """Per-job detector bank; ``observe`` is fed each rank's iteration times in order."""

    method: Method = "bocd-v"
    quorum: float = 0.5
    ranks: dict[int, _RankState] = field(default_factory=dict)
    slow: bool = False

    def _rank(self, rank: int) -> _RankState:
        st = self.ranks.get(rank)
        if st is None:
            st = self.ranks[rank] = _RankState(make_detector(self.method))
        return st

    def _needed(self) -> int:
        return max(1, int(self.quorum * len(self.ranks) + 0.999999))

    def observe(self, rank: int, duration_s: float) -> JobDetection | None:
        st = self._rank(rank)
        st.iterations += 1
        det = st.detector.update(duration_s)
        if det is None:
            return None
        st.last = det
        st.slow = det.kind == "slowdown"
        fired = [r for r, s in self.ranks.items() if s.slow]
        if not self.slow and len(fired) >= self._needed():
            self.slow = True
            return self._decision("slowdown", fired)
        if self.slow and len(fired) < self._needed() and det.kind == "recovery":
            self.slow = False
            recovered = [r for r, s in self.ranks.items()
                         if s.last is not None and s.last.kind == "recovery"]
            return self._decision("recovery", recovered)
        return None

    def _decision(self, kind: str, ranks: list[int]) -> JobDetection:
        dets = [d for r in ranks if (d := self.ranks[r].last) is not None]
        return JobDetection(
            kind=kind, ranks=tuple(sorted(ranks)),
            first_iteration=min(d.index for d in dets),
            detected_iteration=max(d.detected_at for d in dets),
            before_s=float(median(d.before_s for d in dets)),
            after_s=float(median(d.after_s for d in dets)),
        )

    def state_dict(self) -> dict[str, Any]:
        return {"method": self.method, "quorum": self.quorum, "slow": self.slow,
                "ranks": {str(r): {"detector": s.detector.state_dict(), "slow": s.slow,
                                   "iterations": s.iterations} for r, s in self.ranks.items()}}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> JobTracker:
        t = cls(method=state["method"], quorum=float(state["quorum"]), slow=bool(state["slow"]))
        for r, s in state["ranks"].items():
            t.ranks[int(r)] = _RankState(detector_from_state(s["detector"]), slow=bool(s["slow"]),
                                         iterations=int(s["iterations"]))
        return t
