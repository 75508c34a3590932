"""From per-rank iteration times to job-level slowdown and recovery decisions.

Every rank of a synchronous job sees (almost) the same iteration time, so a real fail-slow fires
the detectors of most ranks within an iteration or two, while noise that touches one rank's
measurement fires one. A quorum of ranks therefore decides for the job; the ranks that fired are
kept as a first hint for the analyzer.

A slow job stays under watch: when a quorum of ranks reports a further slowdown (a second fault
on top of the first) or a partial recovery (one of two causes ended), the job reports that too,
with the level before and after, so that the analyzer localises again. Each rank reports one
change once, but not all in the same round; a rank's report counts towards a new job decision
only when its change began ``settle`` rounds after the change the last decision was about, so
the stragglers of one change never add up to a second one.

Two stages, as each rank's detector has them (greyhound.core.levels): the job's slowdown is
*suspected* when a quorum of ranks is slow but fewer than a quorum have confirmed it, and is
then confirmed (once a quorum has) or withdrawn (once fewer than a quorum are still slow) by a
later decision of its own; a quorum of confirmed ranks decides a confirmed slowdown at once.

Warm-up and restarts: each rank's detector decides nothing until its level has settled after the
job's start. A rank whose iteration numbers go back has restarted (its process, with a new
ring): its detector warms up again from that value on, keeping what it had decided.

All ranks of a job advance together through one batched detector (one vectorised step per
"round", a round taking the next pending value of every rank), which is what lets one tracker
process absorb tens of thousands of rank-iterations per second. A rank that falls behind (paused,
hung, its agent late) does not hold the others back: after ``max_lag`` pending values the round
goes ahead without it.

Memory follows the ranks a job has, never the values they carry: ranks map to streams through a
sorted index (a rank of 2^31-1 costs one entry, not an array that long), ``max_ranks`` bounds the
streams of one job, and a message that brings many values of one rank is taken in slices so the
pending queue stays a few rounds deep.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from statistics import median
from typing import Any

import numpy as np
import numpy.typing as npt

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
    """A job-level decision; ``change`` as in `Detection` (onset, further, partial, full)."""

    kind: str  # "slowdown" | "recovery"
    ranks: tuple[int, ...]
    first_iteration: int
    detected_iteration: int
    before_s: float
    after_s: float
    change: str = "onset"
    healthy_s: float = 0.0
    stage: str = "confirmed"
    suspected_iteration: int = -1  # when it was first suspected (-1: not a slowdown)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "ranks": list(self.ranks),
                "first_iteration": self.first_iteration,
                "detected_iteration": self.detected_iteration, "before_s": self.before_s,
                "after_s": self.after_s, "change": self.change, "healthy_s": self.healthy_s,
                "stage": self.stage, "suspected_iteration": self.suspected_iteration}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> JobDetection:
        return cls(str(raw["kind"]), tuple(int(r) for r in raw["ranks"]),
                   int(raw["first_iteration"]), int(raw["detected_iteration"]),
                   float(raw["before_s"]), float(raw["after_s"]), str(raw["change"]),
                   float(raw["healthy_s"]), str(raw["stage"]),
                   int(raw["suspected_iteration"]))


class _Pending:
    """Per-stream FIFO queues of not-yet-detected values, as one (streams, capacity) ring array.

    A message carries many values per rank (several iterations of all the agent's ranks), so
    queueing and popping a round must cost a few numpy calls, not a Python step per value.
    """

    def __init__(self, streams: int, capacity: int = 16) -> None:
        self.buf: npt.NDArray[np.float64] = np.full((streams, capacity), np.nan)
        self.head = np.zeros(streams, dtype=np.int64)
        self.counts = np.zeros(streams, dtype=np.int64)
        self._rows = np.arange(streams)

    def resize(self, streams: int) -> None:
        have = self.buf.shape[0]
        if streams <= have:
            return
        extra = streams - have
        self.buf = np.vstack([self.buf, np.full((extra, self.buf.shape[1]), np.nan)])
        self.head = np.concatenate([self.head, np.zeros(extra, dtype=np.int64)])
        self.counts = np.concatenate([self.counts, np.zeros(extra, dtype=np.int64)])
        self._rows = np.arange(streams)

    def _grow(self, need: int) -> None:
        cap = self.buf.shape[1]
        new_cap = max(2 * cap, need)
        idx = (self.head[:, None] + np.arange(cap)) % cap
        grown = np.full((self.buf.shape[0], new_cap), np.nan)
        grown[:, :cap] = self.buf[self._rows[:, None], idx]
        self.buf = grown
        self.head[:] = 0

    def push(self, streams: npt.NDArray[np.intp], values: npt.NDArray[np.float64]) -> None:
        """Append values in order; equal stream ids keep their relative order (stable sort)."""
        added = np.bincount(streams, minlength=self.buf.shape[0])
        if added.max() <= 1:  # one value per stream (one iteration of each rank): no sorting
            s, vals = streams, values
            occurrence: npt.NDArray[np.intp] | int = 0
        else:
            order = np.argsort(streams, kind="stable")
            s, vals = streams[order], values[order]
            at = np.arange(s.size)
            first = np.empty(s.size, dtype=bool)
            first[0] = True
            np.not_equal(s[1:], s[:-1], out=first[1:])
            occurrence = at - np.maximum.accumulate(np.where(first, at, 0))
        need = int((self.counts + added).max())
        if need > self.buf.shape[1]:
            self._grow(need)
        cap = self.buf.shape[1]
        pos = (self.head[s] + self.counts[s] + occurrence) % cap
        self.buf[s, pos] = vals
        self.counts += added

    def pop_round(self) -> npt.NDArray[np.float64]:
        """The oldest value of every stream that has one; NaN for the others."""
        cap = self.buf.shape[1]
        if self.counts.min() > 0:
            vec = self.buf[self._rows, self.head]
            self.head = (self.head + 1) % cap
            self.counts -= 1
            return vec
        rows = np.flatnonzero(self.counts > 0)
        vec = np.full(self.buf.shape[0], np.nan)
        vec[rows] = self.buf[rows, self.head[rows]]
        self.head[rows] = (self.head[rows] + 1) % cap
        self.counts[rows] -= 1
        return vec

    def lists(self, streams: int) -> list[list[float]]:
        cap = self.buf.shape[1]
        return [[float(self.buf[s, (self.head[s] + i) % cap]) for i in range(int(self.counts[s]))]
                for s in range(streams)]

    @classmethod
    def from_lists(cls, queues: list[list[float]], streams: int) -> _Pending:
        out = cls(streams, max(16, max((len(q) for q in queues), default=0)))
        for s, q in enumerate(queues):
            out.buf[s, : len(q)] = q
            out.counts[s] = len(q)
        return out


class TooManyRanks(ValueError):
    """A job would have more ranks than its tracker's bound (``max_ranks``)."""


# Values of one rank taken from one call before the pending rounds are advanced: the queue holds
# at most max_lag + SLICE values per rank, whatever a message carries.
SLICE = 64


@dataclass
class JobTracker:
    """Per-job detector bank fed with (rank, iteration time) pairs in each rank's order."""

    method: Method = "bocd-v"
    quorum: float = 0.5
    max_lag: int = 8
    settle: int = 16
    slow: bool = False
    max_ranks: int | None = None
    index: dict[int, int] = field(default_factory=dict)  # rank -> stream
    _queue: _Pending = field(default_factory=lambda: _Pending(0))
    # The index as sorted arrays, for vectorised look-ups of a message's ranks.
    _keys: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    _vals: npt.NDArray[np.intp] = field(default_factory=lambda: np.zeros(0, dtype=np.intp))
    _batch: BatchDetector | None = None
    _slow: list[bool] = field(default_factory=list)
    _last: list[Detection | None] = field(default_factory=list)
    _began: list[int] = field(default_factory=list)  # round in which each rank's change began
    _suspected: list[str] = field(default_factory=list)  # a rank's pending suspicion ("": none)
    _iteration: list[int] = field(default_factory=list)  # each rank's newest iteration number
    _mark: int = -(1 << 40)  # round in which the change of the last job decision began
    pending: JobDetection | None = None  # the job's suspected slowdown, not yet confirmed
    rounds: int = 0
    updates: int = 0

    def _lookup(self, ranks: npt.NDArray[np.int64]) -> npt.NDArray[np.intp]:
        """Each rank's stream, -1 for a rank not seen yet."""
        keys = self._keys
        if keys.size == 0:
            return np.full(ranks.size, -1, dtype=np.intp)
        pos = np.minimum(np.searchsorted(keys, ranks), keys.size - 1)
        return np.where(keys[pos] == ranks, self._vals[pos], -1)

    def _reindex(self) -> None:
        keys = np.fromiter(self.index.keys(), dtype=np.int64, count=len(self.index))
        vals = np.fromiter(self.index.values(), dtype=np.intp, count=len(self.index))
        order = np.argsort(keys)
        self._keys, self._vals = keys[order], vals[order]

    def _add_ranks(self, new: list[int]) -> None:
        """Give new ranks their streams (they join at start-up; the batch detector grows and its
        warm-up starts over)."""
        for rank in new:
            self.index[rank] = len(self._slow)
            self._slow.append(False)
            self._last.append(None)
            self._began.append(-(1 << 40))
            self._suspected.append("")
            self._iteration.append(-1)
        s = len(self._slow) - 1
        cap = self._batch.streams if self._batch is not None else 0
        if s >= cap:
            self._batch = make_batch_detector(self.method, max(8, 2 * cap, s + 1))
        self._queue.resize(self._batch.streams if self._batch is not None else s + 1)
        self._reindex()

    def _streams_of(self, ranks: npt.NDArray[np.int64]) -> npt.NDArray[np.intp]:
        streams = self._lookup(ranks)
        if streams.min() >= 0:  # every rank already known: the steady state
            return streams
        new = np.unique(ranks[streams < 0])
        if new[0] < 0:
            raise ValueError(f"ranks must be >= 0, got {int(new[0])}")
        if self.max_ranks is not None and len(self.index) + new.size > self.max_ranks:
            raise TooManyRanks(f"{len(self.index) + new.size} ranks, more than the "
                               f"{self.max_ranks} a job may have")
        self._add_ranks(new.tolist())
        return self._lookup(ranks)

    def _needed(self) -> int:
        return max(1, int(self.quorum * len(self.index) + 0.999999))

    def observe_many(self, ranks: npt.ArrayLike, durations: npt.ArrayLike,
                     iterations: npt.ArrayLike | None = None) -> list[JobDetection]:
        """Queue each rank's values (in its order) and advance every complete (or overdue) round.

        ``iterations``: each value's iteration number, as the rank's agent counts them; a number
        lower than the rank's previous one is a restart of that rank (see the module).
        Raises ValueError (TooManyRanks past ``max_ranks``) before anything is observed when a
        rank is negative or a value is not a finite positive time."""
        r = np.asarray(ranks, dtype=np.int64).reshape(-1)
        d = np.asarray(durations, dtype=np.float64).reshape(-1)
        if r.size != d.size:
            raise ValueError(f"{r.size} ranks but {d.size} durations")
        out: list[JobDetection] = []
        if r.size == 0:
            return out
        if not (np.isfinite(d).all() and (d > 0).all()):
            raise ValueError("iteration times must be finite and > 0")
        it = None if iterations is None else np.asarray(iterations, dtype=np.int64).reshape(-1)
        if it is not None and it.size != r.size:
            raise ValueError(f"{r.size} ranks but {it.size} iteration numbers")
        streams = self._streams_of(r)
        if it is not None:
            # A restart travels with its first value through the queue: the value's sign.
            d = np.where(self._restarts(streams, it), -d, d)
        counts = np.bincount(streams, minlength=self._queue.buf.shape[0])
        if counts.max() <= SLICE:
            self._queue.push(streams, d)
            return self._advance(out)
        # Many values of one rank (a rank far ahead, a replay): take them SLICE at a time.
        order = np.argsort(streams, kind="stable")
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        occurrence = np.empty(r.size, dtype=np.int64)
        occurrence[order] = np.arange(r.size) - starts[streams[order]]
        for lo in range(0, int(counts.max()), SLICE):
            part = (occurrence >= lo) & (occurrence < lo + SLICE)
            self._queue.push(streams[part], d[part])
            self._advance(out)
        return out

    def _restarts(self, streams: npt.NDArray[np.intp], it: npt.NDArray[np.int64]
                  ) -> npt.NDArray[np.bool_]:
        """Which values begin a restart: an iteration number below the one before it (in the
        message, or the rank's newest so far); remembers each rank's newest."""
        order = np.argsort(streams, kind="stable")
        s, n = streams[order], it[order]
        first = np.ones(s.size, dtype=bool)
        first[1:] = s[1:] != s[:-1]
        known = np.asarray(self._iteration, dtype=np.int64)
        prev = np.where(first, known[s], np.concatenate([[0], n[:-1]]))
        back = np.empty(s.size, dtype=bool)
        back[order] = n < prev
        last = np.ones(s.size, dtype=bool)
        last[:-1] = s[:-1] != s[1:]
        for stream, number in zip(s[last].tolist(), n[last].tolist(), strict=True):
            self._iteration[stream] = number
        return back

    def _advance(self, out: list[JobDetection]) -> list[JobDetection]:
        active = len(self.index)
        q = self._queue
        while True:
            counts = q.counts[:active]
            if counts.min() == 0 and counts.max() < self.max_lag:
                break
            assert self._batch is not None
            vec = q.pop_round()
            restarted = np.flatnonzero(vec < 0)
            if restarted.size:
                self._batch.restart(restarted)
                vec = np.abs(vec)
            self.rounds += 1
            self.updates += int(np.count_nonzero(np.isfinite(vec)))
            found = [(s, det) for s, det in enumerate(self._batch.update_many(vec))
                     if det is not None]
            if found:
                decision = self._record(found)
                if decision is not None:
                    out.append(decision)
        return out

    def observe(self, rank: int, duration_s: float) -> JobDetection | None:
        found = self.observe_many([rank], [duration_s])
        return found[-1] if found else None

    def _record(self, found: list[tuple[int, Detection]]) -> JobDetection | None:
        """Judge the quorum after a whole round, so the decision does not depend on rank order."""
        for stream, det in found:
            self._last[stream] = det
            if det.kind == "slowdown":
                self._slow[stream] = True
                self._suspected[stream] = det.change if det.stage == "suspected" else ""
            else:
                if det.change == "withdrawn":
                    self._slow[stream] = self._suspected[stream] == "further"
                else:
                    self._slow[stream] = det.change != "full"
                self._suspected[stream] = ""
            self._began[stream] = self.rounds - (det.detected_at - det.index)
        fired = [r for r, s in self.index.items() if self._slow[s]]
        needed = self._needed()
        if self.pending is not None:
            return self._resolve(fired, needed)
        if not self.slow:
            if len(fired) >= needed:
                self.slow = True
                return self._decision("slowdown", "onset", fired)
            return None
        if any(det.change == "full" for _, det in found) and len(fired) < needed:
            self.slow = False
            # A blip (back within `settle` rounds of its onset) is still over: its recovery
            # began before the settled window, so it is named by every rank that saw it end.
            return self._decision("recovery", "full",
                                  self._latest("full") or self._latest("full", settled=False))
        for change, kind in (("further", "slowdown"), ("partial", "recovery")):
            ranks = self._latest(change)
            if len(ranks) >= needed:
                return self._decision(kind, change, ranks)
        return None

    def _resolve(self, fired: list[int], needed: int) -> JobDetection | None:
        """The job's suspected slowdown: confirmed once a quorum of ranks confirmed theirs,
        withdrawn once fewer than a quorum are still slow with it."""
        p = self.pending
        assert p is not None
        mine = fired if p.change == "onset" else self._latest("further", settled=False)
        confirmed = [r for r in mine if (d := self._last[self.index[r]]) is not None
                     and d.kind == "slowdown" and d.stage == "confirmed"]
        if len(confirmed) >= needed:
            self.pending = None
            found = self._summary("slowdown", p.change, confirmed)
            # after the suspicion (each rank's confirmation follows its own suspicion, but ranks
            # count their points apart): the confirmation is a moment of its own
            return replace(found, stage="confirmed", suspected_iteration=p.detected_iteration,
                           detected_iteration=max(found.detected_iteration,
                                                  p.detected_iteration + 1))
        if len(mine) >= needed:
            return None
        self.pending = None
        if p.change == "onset":
            self.slow = False
        withdrawn = [r for r, s in self.index.items()
                     if (x := self._last[s]) is not None and x.change == "withdrawn"]
        return self._summary("recovery", "withdrawn", withdrawn or list(p.ranks))

    def _latest(self, change: str, *, settled: bool = True) -> list[int]:
        """Ranks whose newest report is `change` about a change after the last decision's
        (``settled``: begun more than `settle` rounds after it)."""
        after = self._mark + self.settle if settled else -(1 << 62)
        return [r for r, s in self.index.items()
                if (d := self._last[s]) is not None and d.change == change
                and self._began[s] > after]

    def _decision(self, kind: str, change: str, ranks: list[int]) -> JobDetection:
        """A new decision about ``ranks``; a slowdown too few of them confirmed is suspected
        (and pending) until its own later decision."""
        streams = [self.index[r] for r in ranks]
        self._mark = min(self._began[s] for s in streams)
        d = self._summary(kind, change, ranks)
        if kind != "slowdown":
            return d
        confirmed = sum(1 for s in streams if (x := self._last[s]) is not None
                        and x.kind == "slowdown" and x.stage == "confirmed")
        stage = "confirmed" if confirmed >= self._needed() else "suspected"
        out = replace(d, stage=stage, suspected_iteration=d.detected_iteration)
        if stage == "suspected":
            self.pending = out
        return out

    def _summary(self, kind: str, change: str, ranks: list[int]) -> JobDetection:
        """The levels and iterations of ``ranks``' newest decisions, as one job decision."""
        dets = [d for r in ranks if (d := self._last[self.index[r]]) is not None]
        return JobDetection(
            kind=kind, ranks=tuple(sorted(ranks)),
            first_iteration=min(d.index for d in dets),
            detected_iteration=max(d.detected_at for d in dets),
            before_s=float(median(d.before_s for d in dets)),
            after_s=float(median(d.after_s for d in dets)),
            change=change, healthy_s=float(median(d.healthy_s for d in dets)),
        )

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume after a tracker restart (pending values included)."""
        return {
            "method": self.method, "quorum": self.quorum, "max_lag": self.max_lag,
            "settle": self.settle, "slow": self.slow,
            "index": {str(r): s for r, s in self.index.items()},
            "pending": self._queue.lists(len(self._slow)), "stream_slow": list(self._slow),
            "last": [d.to_json() if d is not None else None for d in self._last],
            "began": list(self._began), "mark": self._mark, "rounds": self.rounds,
            "suspected": list(self._suspected), "iteration": list(self._iteration),
            "job_pending": self.pending.to_json() if self.pending is not None else None,
            "batch": batch_state(self.method, self._batch) if self._batch is not None else None,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> JobTracker:
        t = cls(method=state["method"], quorum=float(state["quorum"]),
                max_lag=int(state["max_lag"]), settle=int(state.get("settle", 16)),
                slow=bool(state["slow"]))
        t.index = {int(r): int(s) for r, s in state["index"].items()}
        if any(r < 0 for r in t.index) or sorted(t.index.values()) != list(range(len(t.index))):
            raise ValueError("corrupt tracker state: ranks must be >= 0 and streams 0..n-1")
        t._slow = [bool(x) for x in state["stream_slow"]]
        t._last = [Detection.from_json(d) if d is not None else None for d in state["last"]]
        t._began = [int(x) for x in state.get("began", [-(1 << 40)] * len(t._slow))]
        t._mark = int(state.get("mark", -(1 << 40)))
        t.rounds = int(state.get("rounds", 0))
        n = len(t._slow)
        # saved before two stages and restarts: nothing suspected, no iteration known
        t._suspected = [str(x) for x in state.get("suspected", [""] * n)]
        t._iteration = [int(x) for x in state.get("iteration", [-1] * n)]
        raw = state.get("job_pending")
        t.pending = JobDetection.from_json(raw) if raw is not None else None
        t._batch = batch_from_state(state["batch"]) if state["batch"] is not None else None
        rows = t._batch.streams if t._batch is not None else len(t._slow)
        t._queue = _Pending.from_lists([list(q) for q in state["pending"]], rows)
        t._reindex()
        return t
