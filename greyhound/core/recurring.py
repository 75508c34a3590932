"""Recurring bursts (evaluation phases, checkpoints), learned per stream so they are not reported.

A training job evaluates every N iterations and saves a checkpoint every M: for one to a few
iterations the iteration time jumps, then returns. A lone spike never makes a slowdown (the
verification drops it), but an evaluation that takes several iterations at x1.5-3 looks like a
short fail-slow every time it comes. Its regularity gives it away: a burst (a run of points at
least `factor` above the reference, at most `max_len` long) that starts one period after an
earlier one, which itself started one period after another, is recurring. From then on the
points of a burst that starts where the next one is expected (within `tolerance`) are
*expected*: the detector leaves them out of the evidence and decides nothing while inside one.
Only what lasts beyond the learned length counts, so a real slowdown that starts together with
an evaluation is found a burst's length later. A period whose bursts stop coming is forgotten
after `forget` misses.

Vectorised over streams like the detector; only streams whose burst just ended do the
(still vectorised) search for a period.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from greyhound.core.arrays import BoolArray, IntArray

_NONE = -(1 << 40)


@dataclass(frozen=True, slots=True)
class BurstConfig:
    factor: float = 1.5
    max_len: int = 16
    min_period: int = 16
    tolerance: int = 1
    history: int = 8
    forget: int = 3


class RecurringBursts:
    """Per-stream burst history, learned period and the next expected burst."""

    def __init__(self, streams: int, config: BurstConfig | None = None) -> None:
        self.config = config or BurstConfig()
        k = self.config.history
        self.start = np.full(streams, -1, dtype=np.int64)      # current burst's start, or -1
        self.hist = np.full((streams, k), _NONE, dtype=np.int64)  # starts of recent bursts
        self.period = np.zeros(streams, dtype=np.int64)         # 0: none learned
        self.length = np.zeros(streams, dtype=np.int64)         # longest expected burst
        self.expect = np.zeros(streams, dtype=np.int64)         # next expected start
        self.hit = np.zeros(streams, dtype=bool)                # current burst began on time
        self.misses = np.zeros(streams, dtype=np.int64)

    def observe(self, rows: npt.NDArray[np.intp], t: IntArray, elevated: BoolArray) -> BoolArray:
        """Point t of each stream in `rows` (elevated: part of a burst); True where the point
        belongs to an expected burst."""
        c = self.config
        tol = c.tolerance
        st, per, exp = self.start[rows], self.period[rows], self.expect[rows]
        blen, hit, miss = self.length[rows], self.hit[rows], self.misses[rows]
        known = per > 0
        begins = elevated & (st < 0)
        hit = hit | (begins & known & (np.abs(t - exp) <= tol))
        st = np.where(begins, t, st)
        inside = st >= 0
        expected: BoolArray = known & elevated & inside & hit & (t - st < blen + tol)
        # An expected burst that did not come: look one period on; forget after a few.
        passed = known & ~hit & ~inside & (t > exp + blen + tol)
        miss = miss + passed
        exp = exp + np.where(passed, per, 0)
        lost = miss >= c.forget
        per = np.where(lost, 0, per)
        miss = np.where(lost, 0, miss)
        ends = np.flatnonzero(~elevated & inside)
        if ends.size:
            s = st[ends]
            length = t[ends] - s
            short = length <= c.max_len
            on_time = hit[ends] & short
            e = ends[on_time]
            exp[e] = s[on_time] + per[e]
            # A burst much longer than learned is something else that began with it (a
            # slowdown at an evaluation): it does not teach a longer burst.
            grow = length[on_time] <= blen[e] + tol
            blen[e] = np.where(grow, np.maximum(blen[e], length[on_time]), blen[e])
            miss[e] = 0
            found = self._discover(rows[ends], s)
            learn = ~on_time & short & (found > 0) & ((per[ends] == 0) | (miss[ends] > 0))
            e = ends[learn]
            per[e] = found[learn]
            exp[e] = s[learn] + found[learn]
            blen[e] = length[learn]
            miss[e] = 0
            keep = ends[short]
            hist = self.hist[rows[keep]]
            self.hist[rows[keep]] = np.concatenate([hist[:, 1:], s[short, None]], axis=1)
            st[ends] = -1
            hit[ends] = False
        self.start[rows], self.period[rows], self.expect[rows] = st, per, exp
        self.length[rows], self.hit[rows], self.misses[rows] = blen, hit, miss
        return expected

    def _discover(self, rows: npt.NDArray[np.intp], s: IntArray) -> IntArray:
        """The smallest gap g >= min_period such that a stored burst started g before s and
        another one g before that (each within tolerance); 0 when none."""
        c = self.config
        h = self.hist[rows]
        valid = h > _NONE
        gap = s[:, None] - h                                   # (m, K)
        pair = h[:, :, None] - h[:, None, :]                   # (m, K, K): start i after j
        ok = (valid[:, :, None] & valid[:, None, :] & (gap[:, :, None] >= c.min_period)
              & (np.abs(gap[:, :, None] - pair) <= c.tolerance))
        cand = np.where(ok.any(axis=2), gap, np.iinfo(np.int64).max)
        best = cand.min(axis=1)
        out: IntArray = np.where(best == np.iinfo(np.int64).max, 0, best)
        return out

    def state_dict(self) -> dict[str, Any]:
        c = self.config
        return {"config": {f: getattr(c, f) for f in c.__slots__},
                "start": self.start.tolist(), "hist": self.hist.tolist(),
                "period": self.period.tolist(), "length": self.length.tolist(),
                "expect": self.expect.tolist(), "hit": self.hit.tolist(),
                "misses": self.misses.tolist()}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> RecurringBursts:
        start = np.asarray(state["start"], dtype=np.int64)
        out = cls(start.shape[0], BurstConfig(**state["config"]))
        out.start = start
        out.hist = np.asarray(state["hist"], dtype=np.int64).reshape(start.shape[0], -1)
        for name in ("period", "length", "expect", "misses"):
            setattr(out, name, np.asarray(state[name], dtype=np.int64))
        out.hit = np.asarray(state["hit"], dtype=bool)
        return out
