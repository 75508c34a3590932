"""Iteration period of a rank's collective-call stream, and iteration times from it.

GREYHOUND takes the period as the smallest lag whose autocorrelation of the call sequence exceeds
0.95. For a categorical sequence (one int64 key per call: op, communicator, size) the natural
autocorrelation is the agreement rate `mean(keys[i] == keys[i + k])`. One missing or extra call
shifts the alignment for the next k comparisons, so a plain agreement rate over a few periods
falls below 0.95 after a couple of glitches. We therefore score a lag by the *median over blocks*
of the agreement rate: a glitch spoils at most the two blocks its k comparisons touch, and the
median ignores them as long as most blocks are clean. Candidate lags come from the recurrence of
the first few keys, so the search costs O(n * candidates) instead of O(n * max_lag).

Iteration time (paper): the time between an op and the same op one period earlier. We use the
ops that occur exactly once per period ("anchors"), take each anchor's gap to its previous
occurrence: the primary anchor's gap is the iteration time, and the median gap of the others
tells when a primary call went missing (its gap then spans two iterations and is split).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from greyhound.core.arrays import IntArray


def lag_agreement(keys: IntArray, lag: int, blocks: int = 16) -> float:
    """Median over `blocks` contiguous blocks of the rate keys[i] == keys[i + lag]."""
    n = keys.shape[0] - lag
    if lag <= 0 or n <= 0:
        return 0.0
    eq = (keys[:n] == keys[lag:]).astype(np.float64)
    b = max(1, min(blocks, n // max(lag, 1)))
    return float(np.median([part.mean() for part in np.array_split(eq, b)]))


def whole_periods(keys: IntArray, lag: int) -> bool:
    """True when every key occurs equally often in each `lag`-call span of `keys`, counted over
    the longest whole number of spans that ends with the newest call.

    A sub-period passes the agreement test when one op is rare: a pipeline stage's send/recv
    pairs repeat per micro-batch and its one data-parallel all-reduce per iteration spoils two
    comparisons in each iteration's worth, which the block median skips. That op then occurs in
    some spans of the sub-period and not in others, which a true period cannot show over any
    whole number of its spans. (Before the rare op has been seen at all, nothing can tell.)
    """
    spans = keys.shape[0] // lag if lag > 0 else 0
    if spans == 0:
        return False
    _, counts = np.unique(keys[-lag * spans:], return_counts=True)
    return bool((counts % spans == 0).all())


def find_period(keys: npt.ArrayLike, *, threshold: float = 0.95,
                max_lag: int | None = None, probes: int = 8, whole: bool = False) -> int | None:
    """Smallest lag whose block-median agreement exceeds `threshold` (None: no period yet).

    Needs several periods of calls: lags above len(keys) // 4 are not considered by default.
    With ``whole`` the lag must also hold every op equally often in each of its spans
    (`whole_periods`), so a sub-period of a stream with a rare op is passed over.
    """
    k = np.asarray(keys, dtype=np.int64).reshape(-1)
    n = k.shape[0]
    hi = min(max_lag if max_lag is not None else n // 4, n - 1)
    if hi < 1:
        return None
    votes: dict[int, int] = {}
    for j in range(min(probes, n)):
        for p in np.flatnonzero(k[j + 1: j + 1 + hi + 1] == k[j]).tolist():
            lag = p + 1
            if lag <= hi:
                votes[lag] = votes.get(lag, 0) + 1
    need = max(1, min(probes, n) // 2)
    for lag in sorted(lag for lag, v in votes.items() if v >= need):
        if lag_agreement(k, lag) > threshold and (not whole or whole_periods(k, lag)):
            return lag
    return None


@dataclass(frozen=True, slots=True)
class Iteration:
    index: int
    end_ns: int
    duration_s: float


class IterationSegmenter:
    """Online: calls of one rank in, iterations out; re-learns the period when the pattern changes.

    Feed `feed(keys, enter_ns, exit_ns)` batches in call order. Until a period is known the calls
    are buffered; then every occurrence of the primary anchor closes an iteration.
    """

    def __init__(self, *, threshold: float = 0.95, min_periods: int = 6, max_buffer: int = 65536,
                 max_anchors: int = 8) -> None:
        self.threshold = threshold
        self.min_periods = min_periods
        self.max_buffer = max_buffer
        self.max_anchors = max_anchors
        self.period: int | None = None
        self.anchors: tuple[int, ...] = ()
        self._buf_keys: list[int] = []
        self._buf_t: list[int] = []
        self._last_seen: dict[int, int] = {}
        self._counts: dict[int, int] = {}  # each other anchor's calls since the last primary
        self._gaps: dict[int, int] = {}
        self._since_primary = 0
        self._misses = 0
        self._index = 0
        self._last_primary_ns: int | None = None

    def feed(self, keys: npt.ArrayLike, enter_ns: npt.ArrayLike,
             exit_ns: npt.ArrayLike) -> list[Iteration]:
        k = np.asarray(keys, dtype=np.int64).reshape(-1).tolist()
        t = np.asarray(enter_ns, dtype=np.int64).reshape(-1).tolist()
        if len(k) != len(t) or len(k) != np.asarray(exit_ns).reshape(-1).shape[0]:
            raise ValueError("keys, enter_ns and exit_ns must have the same length")
        return list(self._consume(k, t))

    def _consume(self, keys: list[int], times: list[int]) -> Iterator[Iteration]:
        for key, ts in zip(keys, times, strict=True):
            if self.period is None:
                self._buf_keys.append(key)
                self._buf_t.append(ts)
                if len(self._buf_keys) > self.max_buffer:
                    del self._buf_keys[: len(self._buf_keys) - self.max_buffer]
                    del self._buf_t[: len(self._buf_t) - self.max_buffer]
                if len(self._buf_keys) % 32 == 0:
                    yield from self._try_lock()
                continue
            yield from self._step(key, ts)

    def _try_lock(self) -> Iterator[Iteration]:
        keys = np.asarray(self._buf_keys, dtype=np.int64)
        period = find_period(keys, threshold=self.threshold,
                             max_lag=len(keys) // self.min_periods, whole=True)
        if period is None:
            return
        recent = keys[-period * self.min_periods:]
        values, counts = np.unique(recent, return_counts=True)
        once = [int(v) for v, c in zip(values.tolist(), counts.tolist(), strict=True)
                if c == self.min_periods]
        if not once:
            return  # no op occurs exactly once per period: keep buffering
        # Anchors in call order within the last period, the first one is primary.
        last = keys[-period:].tolist()
        self.anchors = tuple(sorted(once, key=lambda v: last.index(v) if v in last else period)
                             [: self.max_anchors])
        self.period = period
        buf_k, buf_t = self._buf_keys, self._buf_t
        self._buf_keys, self._buf_t = [], []
        # Replay the buffered calls so the first iterations are not lost; should the pattern
        # change within them (the period is lost again), the rest waits for the next lock.
        for i, (key, ts) in enumerate(zip(buf_k, buf_t, strict=True)):
            if self.period is None:
                self._buf_keys, self._buf_t = buf_k[i:], buf_t[i:]
                return
            yield from self._step(key, ts)

    def _step(self, key: int, ts: int) -> Iterator[Iteration]:
        assert self.period is not None
        self._since_primary += 1
        if key in self.anchors:
            prev = self._last_seen.get(key)
            if prev is not None:
                self._gaps[key] = ts - prev
            self._last_seen[key] = ts
            self._counts[key] = self._counts.get(key, 0) + 1
        if key == self.anchors[0]:
            if self._last_primary_ns is not None:
                yield from self._close(ts)
            self._last_primary_ns = ts
            self._since_primary = 0
            self._counts.clear()
        elif self._since_primary > 3 * self.period:
            self._relearn()

    def _close(self, ts: int) -> Iterator[Iteration]:
        assert self.period is not None and self._last_primary_ns is not None
        primary_gap = ts - self._last_primary_ns
        calls = self._since_primary
        gaps = [g for g in self._gaps.values() if g > 0]
        typical = float(np.median(gaps)) if gaps else float(primary_gap)
        # A missing primary call makes its gap span two iterations: split it between them.
        steps = max(1, round(primary_gap / typical)) if typical > 0 else 1
        if not (0.5 * self.period <= calls <= 2.5 * self.period and self._anchors_agree(steps)):
            self._misses += 1
            if self._misses >= 3:
                self._relearn()
            return
        self._misses = 0
        for s in range(steps):
            self._index += 1
            end = self._last_primary_ns + round((s + 1) * primary_gap / steps)
            yield Iteration(self._index - 1, end, primary_gap / steps / 1e9)

    def _anchors_agree(self, steps: int) -> bool:
        """The other anchors came once per iteration since the last primary, bar one glitch in
        three. When the pattern changes so that the primary recurs within an iteration (a
        micro-batch plan gives a pipeline stage more micro-batches again: its per-micro-batch
        receive was once per iteration), the calls between primaries may still number about a
        period while the other anchors are missing from most gaps: such gaps are no iteration.
        """
        others = self.anchors[1:]
        wrong = sum(self._counts.get(a, 0) != steps for a in others)
        return wrong <= max(0, len(others) - 1) // 2

    def _relearn(self) -> None:
        """The call pattern changed (new phase, new parallel layout): find the period again."""
        self.period = None
        self.anchors = ()
        self._last_seen.clear()
        self._counts.clear()
        self._gaps.clear()
        self._since_primary = 0
        self._misses = 0
        self._last_primary_ns = None
