"""BOCD+V: Bayesian online change points (Adams & MacKay 2007) and their verification, batched.

One numpy step updates R independent streams at once, because the tracker sees every rank of a
job per iteration and a Python call per rank would cost more than the arithmetic.

The change-point model (`BocdBatch`):

- observations are log iteration times, so a fail-slow of factor f is an additive step log(f)
  whatever the job's own iteration time;
- Normal-Gamma conjugate prior per run, Student-t posterior predictive, constant hazard h;
- the run-length posterior is truncated to W slots: slot k (k < W-1) is "the current run holds the
  last k+1 points"; the last slot is the long run, whose sufficient statistics decay with factor
  `decay` so it follows slow drift instead of averaging the whole job;
- the degrees of freedom of the predictive are capped (`nu_cap`): a single GC pause or checkpoint
  iteration then costs the long run a bounded log-likelihood instead of killing it;
- the prior mean and scale are per stream (`mu0`, `sigma0`) so that a new run is judged against
  the stream's own noise level from its first points.

The verification (`BocdVBatch`), what real iteration times need on top of it. Recorded runs show
~5% jitter, evaluation and checkpoint spikes of x5-60, stalls, a healthy level that wanders by a
few percent between plateaus, and intermittent slowdowns (CPU contention) that flicker between
x1.2 and x2.2. The paper's rule (before/after means differ by >= 10%) fires on all of that.

- Candidates: BOCD's most probable run is recent and holds `confirm` points, or the robust level
  (median of the last `level_points`) is a threshold away from the reference. The second catches
  a step on top of a mild elevation, whose run posterior spreads over several starts.
- Warm-up: a stream decides nothing for its first `min_seen` points and until its level has
  settled (two spans of `settle` points agree within half a threshold); its healthy level is
  then that settled level, unless an earlier steady stretch of the warm-up sat a threshold
  below it: a fail-slow that began inside the warm-up, judged from that earlier level. The
  first iterations of a job, slower than what follows, are no change point; a stream whose
  source restarted (`restart`) warms up again, keeping what it had decided.
- Reference: while healthy, a healthy level that follows slowly (`healthy_rate`) the robust
  level of `before` points ago, so drift and sub-threshold plateaus are absorbed but a slowdown
  that takes many points to prove, or a ramp to a mild one, does not lift its own baseline
  while it is judged, nor does the dip after one; it is held while slow, and reset at once only
  by a confident fall of `fall` thresholds: the return from a dip is no slowdown. While slow,
  the median of the slow points before the change (since the last decision), so that a
  further change is measured from where the job is.
- Noise: the jitter the evidence is judged against is the median successive difference over
  the window (`suspicion.recent_noise`), not the running average BOCD's prior uses, which stays
  inflated for dozens of points after a noisy stretch: a slowdown that begins while the level is
  still settling from an earlier disturbance needs no clean baseline right before it.
- Start: a sign CUSUM over the candidate stretch places the change where the points turn beyond
  the threshold, not at a stall before it nor at the start of a mild elevation.
- Spikes: points above `spike` x the reference are dropped from the evidence (evaluation,
  checkpoint, GC and loader stalls); a change made mostly of them counts only after
  `spike_persist` points, so a sustained huge slowdown is still reported.
- Decision: the mean log level since the change, with its standard error from the points' own
  spread (never below the stream's jitter) and the reference's; a change counts when it clears
  `rel` by `z` standard errors. Short confident steps are found in `confirm` points; small or
  flickering ones wait for the evidence, and a run of x1.1 that merely looks like 12% does not
  pass. Persistence: at most one point in `persist` may sit back on the old side of the
  midpoint, so a two-iteration transient next to a stall is not a slowdown.
- Median path: contention that flickers (every other iteration or so 12-25% slower for 8-40
  iterations) has a mean under the threshold and points back on the old side everywhere, yet
  is a fail-slow by the labels' own rule, most of the points slow. When the trailing median of
  `median_window` points has stayed the threshold above the healthy level, plus `z` standard
  errors of such a median (the jitter from before), for `median_run` iterations in a row, the
  slowdown is accepted from where that run began, less the median's half window; it rests on
  that many points and is confirmed as it is raised, or confirms a suspicion of it that the
  mean could not.
- Recurring bursts (`recurring.RecurringBursts`): an evaluation that takes a few iterations
  every N looks like a short fail-slow each time; once its period is learned, the points of a
  burst that comes on time are left out of the evidence for the burst's learned length, and no
  decision is taken inside one.
- Two stages: a slowdown decided on fewer than `hold` points since its start (the spikes it
  starts with left out, so an evaluation step before a 4-iteration burst is not a fifth) is suspected
  (`LevelState`); every later point re-runs the test on all the points since (`suspicion.held`)
  until it is confirmed, or withdrawn when the level is confidently back below the threshold,
  or when `recent` points pass without it holding.
- The decision itself (onset, further slowdown, partial or full recovery) is `LevelState`'s.

Cost per step is O(R * W) numpy for the BOCD step, plus O(m * (recent + before)) numpy for the m
streams holding a candidate, verified together; Python runs only for the decisions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from greyhound.core.levels import NORMAL, SLOW, Detection, LevelState, iteration_batch
from greyhound.core.recurring import BurstConfig, RecurringBursts
from greyhound.core.suspicion import held, masked_median, recent_noise, settled

FloatArray = npt.NDArray[np.float64]

#: Log-probability floor: keeps the state finite (JSON-serialisable) without changing results.
LOG_FLOOR = -1.0e4


@dataclass(frozen=True, slots=True)
class BocdParams:
    """Model constants shared by all streams of a batch."""

    window: int = 32
    hazard: float = 1.0 / 250.0
    kappa0: float = 0.05
    alpha0: float = 1.0
    nu_cap: float = 4.0
    decay: float = 1.0 - 1.0 / 128.0


class BocdBatch:
    """Run-length posterior of R streams, advanced one observation per stream per `step`."""

    def __init__(self, streams: int, params: BocdParams | None = None) -> None:
        self.params = params or BocdParams()
        w = self.params.window
        if w < 4:
            raise ValueError("window must be >= 4")
        self.streams = streams
        self.logp: FloatArray = np.full((streams, w), LOG_FLOOR)
        self.logp[:, 0] = 0.0
        self.n: FloatArray = np.zeros((streams, w))
        self.s1: FloatArray = np.zeros((streams, w))
        self.s2: FloatArray = np.zeros((streams, w))
        self.seen = np.zeros(streams, dtype=np.int64)
        self.reborn = np.zeros(streams, dtype=bool)  # the next observation starts a new run
        self._constants()

    def _constants(self) -> None:
        """Per-slot Student-t normalising terms: they depend on the run length only."""
        p = self.params
        w = p.window
        # Slot k holds k+1 points; the long slot is treated as "many" points, so its nu is capped.
        counts = np.arange(1, w + 1, dtype=np.float64)
        counts[-1] = max(counts[-1], 2.0 * p.nu_cap)
        alpha = p.alpha0 + counts / 2.0
        nu = 2.0 * np.minimum(alpha, p.nu_cap / 2.0 if p.nu_cap > 0 else alpha)
        self._nu: FloatArray = nu
        self._lognorm: FloatArray = np.array(
            [math.lgamma((v + 1.0) / 2.0) - math.lgamma(v / 2.0) - 0.5 * math.log(v * math.pi)
             for v in nu]
        )
        nu0 = 2.0 * p.alpha0
        self._nu0 = nu0
        self._lognorm0 = (
            math.lgamma((nu0 + 1.0) / 2.0) - math.lgamma(nu0 / 2.0) - 0.5 * math.log(nu0 * math.pi)
        )
        self._log_h = math.log(p.hazard)
        self._log_1mh = math.log1p(-p.hazard)

    def step(self, y: FloatArray, mu0: FloatArray, sigma0: FloatArray,
             rows: npt.NDArray[np.intp] | None = None) -> FloatArray:
        """Absorb y (R,) or y for `rows`; returns the updated log posterior of those rows.

        mu0 and sigma0 are the prior mean and noise scale per stream (same shape as y).
        """
        p = self.params
        sel: Any = slice(None) if rows is None else rows
        logp, n, s1, s2 = self.logp[sel], self.n[sel], self.s1[sel], self.s2[sel]
        yc = y[:, None]
        m0 = mu0[:, None]
        beta0 = (p.alpha0 * sigma0 * sigma0)[:, None]
        # Posterior predictive of every existing run.
        kappa = p.kappa0 + n
        mu = (p.kappa0 * m0 + s1) / kappa
        safe_n = np.maximum(n, 1.0)
        ssd = np.maximum(s2 - s1 * s1 / safe_n, 0.0)
        dev = s1 - n * m0
        alpha = p.alpha0 + 0.5 * n
        beta = beta0 + 0.5 * ssd + 0.5 * p.kappa0 * dev * dev / (safe_n * kappa)
        scale2 = beta * (kappa + 1.0) / (alpha * kappa)
        z2 = (yc - mu) ** 2 / (self._nu * scale2)
        pred = self._lognorm - 0.5 * np.log(scale2) - 0.5 * (self._nu + 1.0) * np.log1p(z2)
        # Prior predictive of a new run (n = 0).
        scale20 = sigma0 * sigma0 * (p.kappa0 + 1.0) / p.kappa0
        z20 = (y - mu0) ** 2 / (self._nu0 * scale20)
        pred0 = self._lognorm0 - 0.5 * np.log(scale20) - 0.5 * (self._nu0 + 1.0) * np.log1p(z20)
        grow = logp + pred + self._log_1mh
        new: FloatArray = np.empty_like(logp)
        new[:, 1:] = grow[:, :-1]
        # logp is normalised, so the change mass is h * p0(y) * sum(P) = h * p0(y).
        new[:, 0] = self._log_h + pred0
        keep_long = grow[:, -1] >= grow[:, -2]
        new[:, -1] = np.logaddexp(grow[:, -2], grow[:, -1])
        new -= new.max(axis=1, keepdims=True)
        new -= np.log(np.exp(new).sum(axis=1, keepdims=True))
        np.maximum(new, LOG_FLOOR, out=new)
        # Sufficient statistics: every run grows by y, a new run starts with y alone.
        y2 = yc * yc
        nn = np.empty_like(n)
        ns1 = np.empty_like(s1)
        ns2 = np.empty_like(s2)
        nn[:, 1:] = n[:, :-1] + 1.0
        ns1[:, 1:] = s1[:, :-1] + yc
        ns2[:, 1:] = s2[:, :-1] + y2
        d = p.decay
        nn[:, -1] = np.where(keep_long, n[:, -1] * d + 1.0, nn[:, -1])
        ns1[:, -1] = np.where(keep_long, s1[:, -1] * d + y, ns1[:, -1])
        ns2[:, -1] = np.where(keep_long, s2[:, -1] * d + y * y, ns2[:, -1])
        nn[:, 0] = 1.0
        ns1[:, 0] = y
        ns2[:, 0] = y * y
        # A stream's first observation has no run to grow: it starts one.
        first = (self.seen[sel] == 0) | self.reborn[sel]
        if first.any():
            new[first] = LOG_FLOOR
            new[first, 0] = 0.0
        if rows is None:
            self.logp, self.n, self.s1, self.s2 = new, nn, ns1, ns2
            self.seen += 1
        else:
            self.logp[rows], self.n[rows], self.s1[rows], self.s2[rows] = new, nn, ns1, ns2
            self.seen[rows] += 1
        self.reborn[sel] = False
        return new

    def restart(self, rows: npt.NDArray[np.intp]) -> None:
        """Forget the runs of ``rows``: their next observation starts one, as a first one does
        (positions go on counting)."""
        self.reborn[rows] = True

    def state_dict(self) -> dict[str, Any]:
        p = self.params
        return {
            "params": {"window": p.window, "hazard": p.hazard, "kappa0": p.kappa0,
                       "alpha0": p.alpha0, "nu_cap": p.nu_cap, "decay": p.decay},
            "logp": self.logp.tolist(), "n": self.n.tolist(),
            "s1": self.s1.tolist(), "s2": self.s2.tolist(), "seen": self.seen.tolist(),
            "reborn": self.reborn.tolist(),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> BocdBatch:
        raw = state["params"]
        params = BocdParams(window=int(raw["window"]), hazard=float(raw["hazard"]),
                            kappa0=float(raw["kappa0"]), alpha0=float(raw["alpha0"]),
                            nu_cap=float(raw["nu_cap"]), decay=float(raw["decay"]))
        logp = np.asarray(state["logp"], dtype=np.float64)
        out = cls(logp.shape[0], params)
        out.logp = logp
        out.n = np.asarray(state["n"], dtype=np.float64)
        out.s1 = np.asarray(state["s1"], dtype=np.float64)
        out.s2 = np.asarray(state["s2"], dtype=np.float64)
        out.seen = np.asarray(state["seen"], dtype=np.int64)
        out.reborn = np.asarray(state.get("reborn", [False] * out.streams), dtype=bool)
        return out


@dataclass(frozen=True, slots=True)
class BocdVConfig:
    """Decision constants of BOCD+V on top of the BOCD posterior (see the module docstring).

    The model's few free choices, and what they rest on:

    - ``rel`` 10%: the paper's verification threshold; labels call a fail-slow 12-15% and up.
    - ``z`` 2: a change clears ``rel`` by two standard errors of its own mean; with recorded
      jitter of 2.5-7% a 15% step needs 4-10 points of evidence, a 50% one four.
    - ``confirm`` 4: the fewest points a suspicion rests on (three agree by chance in flicker).
    - ``hold`` 5: the points a slowdown must hold from its start to be confirmed, counted
      without the spikes it starts with (an evaluation step right before a 4-iteration burst
      made it five). The shortest fail-slow is 8 iterations; bursts of 3-4 iterations
      (1.3-2.5x) made the false alarms on
      traces from outside the project; and a median latency of 5 iterations allows no more,
      since on recorded traces the estimated start trails the labelled onset by 1-3 iterations.
    - ``persist`` 6: a suspicion allows one point in six back on the old side of the midpoint
      (5% jitter puts a 15% slowdown's point there about once in twelve).
    - ``min_seen`` 48 and ``settle`` 8: warm-up. Two recent windows before the first decision,
      so a first phase at another level (a pipeline filling, prefetching, the simulator's first
      pieces) is over; then two spans of 8 points whose medians agree within 5%: recorded
      warm-ups decay over 30-130 iterations.
    - ``spike`` 4x: evaluation and checkpoint steps are 5-60x, GC and loader stalls 1.3-8x; a
      change made of points above 4x counts only after ``spike_persist`` (8) points.
    - ``recent`` 24 / ``before`` 32: the window a change is looked for in, and the slow level
      before it; a suspicion not proved within ``recent`` points is withdrawn.
    - ``healthy_rate`` 1/96, ``fall`` 2: the healthy level follows drift over ~100 iterations
      (plateaus last 100-600), from the level of ``before`` points ago, and is reset at once
      only by a fall of two thresholds. Following later points hid ramps to mild slowdowns
      (1-2% of hostile jobs missed); following the lagged level leaves a sub-threshold step
      with a second one on top within ~30 iterations above 10% (about 1% of healthy hostile
      jobs flagged): the two cannot be told apart by the level alone.
    - ``median_window`` 9 and ``median_run`` 8: the second acceptance path (`_median_path`)
      is the labels' own definition of a fail-slow, the median of 9 iterations above the
      threshold for at least 8 in a row (`greyhound.traces.hindsight`), trailing instead of
      centred, the threshold ``rel`` plus ``z`` standard errors of such a median. A run of
      ``median_run`` high medians needs about as many slow points, so the bursts of 3-4
      iterations (with a stall or an evaluation step beside them: five) stay below it; with 4
      the hostile generator's healthy jobs were flagged at 2-2.5% on the two seeds tried, with
      8 none more than before on any of 10. Raised 11 iterations after the labelled start at
      the earliest (the trailing median lags the centred one by half a window), inside the 15
      a detection may take; with 10 realistic recall fell back by 1-3 points, too late. The
      margin of ``z`` standard errors: without it realistic false alarms nearly doubled.

    The rest (``noise_*``, ``level_points``, ``threshold``, ``trigger``, ``refine``, ``burst``)
    shape BOCD's prior and the candidate search, not what counts as a slowdown.
    """

    rel: float = 0.10
    confirm: int = 4
    recent: int = 24
    threshold: float = 0.9
    before: int = 32
    validate: bool = True
    noise_floor: float = 0.004
    noise_init: float = 0.03
    noise_rate: float = 1.0 / 32.0
    level_points: int = 5
    min_seen: int = 48
    z: float = 2.0
    healthy_rate: float = 1.0 / 96.0
    fall: float = 2.0
    noise_clip: float = 2.5
    spike: float = 4.0
    spike_persist: int = 8
    refine: int = 3
    trigger: float = 1.0
    burst: float = 1.5
    learn: bool = True
    persist: int = 6
    hold: int = 5
    settle: int = 8
    median_window: int = 9
    median_run: int = 8


class BocdVBatch:
    """BOCD+V (or plain BOCD with `validate=False`) over R streams of iteration times.

    `update_many` costs one vectorised BOCD step plus Python work only for the rare streams that
    hold a candidate change, which is what makes the tracker's per-iteration update of all ranks
    of a job cheap.
    """

    def __init__(self, streams: int, *, params: BocdParams | None = None,
                 config: BocdVConfig | None = None) -> None:
        self.config = config or BocdVConfig()
        self.core = BocdBatch(streams, params)
        c = self.config
        if c.recent >= self.core.params.window:
            raise ValueError("recent must be smaller than the BOCD window")
        if c.confirm < 2 or c.spike <= 1.0 + c.rel:
            raise ValueError("confirm must be >= 2 and spike above 1 + rel")
        if not c.confirm <= c.hold <= c.recent or c.settle < 2 or 2 * c.settle > c.recent:
            raise ValueError("hold must lie in [confirm, recent] and settle in [2, recent / 2]")
        if not 3 <= c.median_window <= c.recent or not 0 <= c.median_run <= c.before:
            raise ValueError("median_window must lie in [3, recent] and median_run in [0, before]")
        self.streams = streams
        self.level = np.zeros(streams)
        self.noise = np.full(streams, c.noise_init)
        self.last = np.zeros(streams)
        self.healthy = np.zeros(streams)
        self.ref = np.zeros(streams)
        self.slow = np.zeros(streams, dtype=bool)
        self.hist = c.recent + c.before
        self.ring = np.zeros((streams, self.hist))  # the last `hist` log values
        self.levels = np.zeros((streams, self.hist))  # and the robust level at each of them
        self.expected = np.zeros((streams, self.hist), dtype=bool)
        self.bursts = RecurringBursts(streams, BurstConfig(factor=c.burst))
        self.last_index = np.full(streams, -1, dtype=np.int64)
        self.states = [LevelState() for _ in range(streams)]
        self.born = np.zeros(streams, dtype=np.int64)      # position the stream (re)started at
        self.settling = np.ones(streams, dtype=bool)       # warm-up: its level not yet steady
        self.pending = np.full(streams, -1, dtype=np.int64)  # a suspected slowdown's start
        self.pending_ref = np.zeros(streams)              # and the log level it rose from
        self.median_run = np.zeros(streams, dtype=np.int64)  # how long it has been high
        self._all = np.arange(streams)
        self._lag = np.arange(self.config.level_points)
        self._tail = np.arange(self.config.confirm - 1, -1, -1)

    def update_many(self, values: npt.ArrayLike) -> list[Detection | None]:
        """One iteration time (seconds) per stream; NaN (or <= 0) skips that stream this time."""
        x, ok = iteration_batch(values, self.streams)
        out: list[Detection | None] = [None] * self.streams
        if ok.all():
            rows: npt.NDArray[np.intp] | None = None
            xs = x
        else:
            rows = np.flatnonzero(ok)
            if rows.size == 0:
                return out
            xs = x[rows]
        sel: Any = slice(None) if rows is None else rows
        c = self.config
        y = np.log(xs)
        seen = self.core.seen[sel].copy()
        rr = self._all if rows is None else rows
        fresh = seen == self.born[sel]
        if fresh.any():
            # A new (or restarted) stream starts with its first value as history, so medians
            # are defined.
            self.ring[rr[fresh]] = y[fresh, None]
            self.level[rr[fresh]] = y[fresh]
            self.last[rr[fresh]] = y[fresh]
        noise = self.noise[sel]
        t = seen  # position of this point in its stream
        if c.learn and c.validate:
            # Points of a recurring burst (evaluation, checkpoint) that came when expected.
            prev = np.where(self.slow[sel], self.ref[sel], self.healthy[sel])
            expected = self.bursts.observe(rr, t, (y > prev + math.log(c.burst)) & (t > 0))
        else:
            expected = np.zeros(rr.shape[0], dtype=bool)
        self.expected[rr, t % self.hist] = expected
        logp = self.core.step(y, self.level[sel], noise, rows)
        # Noise scale from successive differences (immune to level steps), clipped so a spike
        # moves it by a bounded amount; the prior mean of a new run is the median of the last
        # few points, which follows warm-up and drift but not a single spike.
        d = np.minimum(np.abs(y - self.last[sel]) / 1.128, c.noise_clip * noise)
        self.noise[sel] = np.maximum(noise + c.noise_rate * (d - noise), c.noise_floor)
        self.last[sel] = y
        self.ring[rr, t % self.hist] = y
        cols = (t[:, None] - self._lag) % self.hist
        level = np.median(self.ring[rr[:, None], cols], axis=1)
        self.level[sel] = level
        self.levels[rr, t % self.hist] = level
        # The healthy level is the level itself while a healthy stream warms up, holds while
        # slow, and otherwise follows slowly (a spike's pull bounded at a threshold) the robust
        # level of `before` points ago: drift and sub-threshold plateaus are absorbed, while
        # what is still being judged (a slowdown that takes many points to prove, a ramp to a
        # mild one) does not lift its own baseline.
        h = self.healthy[sel]
        slow = self.slow[sel]
        settling = self.settling[sel]
        cap = math.log1p(c.rel)
        past = self.levels[rr, (t - c.before) % self.hist]
        source = np.where(t - self.born[sel] >= c.before + c.level_points, past, level)
        h = np.where(settling & ~slow, level,
                     np.where(slow, h, h + c.healthy_rate * np.clip(source - h, -cap, cap)))
        self.healthy[sel] = h
        if settling.any():
            settling = self._settle(rr, t, settling)
        kmap = logp.argmax(axis=1)
        start = t - kmap
        last_index = self.last_index[sel]
        # BOCD's candidates: the most probable run is recent and holds `confirm` points. The
        # level trigger catches what the run posterior spreads over several starts (a change on
        # top of a mild elevation): the robust level itself is a threshold away from the reference.
        ref = np.where(self.slow[sel], self.ref[sel], self.healthy[sel])
        bocd = (kmap >= c.confirm - 1) & (kmap < c.recent) & (start > last_index)
        moved = np.abs(level - ref) >= c.trigger * math.log1p(c.rel)
        cand = ~settling & (bocd | moved) & ~expected
        decided = np.zeros(rr.shape[0], dtype=bool)
        if cand.any():
            idx = np.flatnonzero(cand)
            sure = bocd[idx] & (np.exp(logp[idx, : c.recent]).sum(axis=1) > c.threshold)
            idx = idx[sure | moved[idx]]
            sigma = self._noise(rr[idx], t[idx]) if idx.size else np.zeros(0)
            if c.validate and idx.size:
                plausible = self._plausible(rr[idx], t[idx], ref[idx], sigma)
                idx, sigma = idx[plausible], sigma[plausible]
            if idx.size:
                lookback = np.where(bocd, start - c.refine, t - self.hist + 1)
                found = self._validate(rr[idx], t[idx], lookback[idx], sigma)
                for j, row, det in zip(idx.tolist(), rr[idx].tolist(), found, strict=True):
                    out[row] = det
                    decided[j] = det is not None
        waiting = (self.pending[sel] >= 0) & ~decided & ~expected & ~settling
        if waiting.any():
            idx = np.flatnonzero(waiting)
            for j, row, det in zip(idx.tolist(), rr[idx].tolist(), self._hold(rr[idx], t[idx]),
                                   strict=True):
                out[row] = det
                decided[j] |= det is not None
        if c.validate and c.median_run > 0:
            self._median_path(rr, t, settling, expected, decided, out)
        return out

    def _median_path(self, rows: npt.NDArray[np.intp], t: npt.NDArray[np.int64],
                     settling: npt.NDArray[np.bool_], expected: npt.NDArray[np.bool_],
                     decided: npt.NDArray[np.bool_], out: list[Detection | None]) -> None:
        """The labels' own test, for a slowdown the mean and its persistence refuse: the
        trailing median of the last ``median_window`` points (expected bursts left out) has
        stayed ``rel`` above the healthy level, plus ``z`` standard errors of a median of that
        many points (the jitter from before the run), for ``median_run`` iterations in a row.

        Most of the points are then slow, which is what the hindsight labels call a fail-slow
        (their centred median over the same window, above the threshold for as many
        iterations); contention that flickers, slow on half its iterations, has a mean under
        the threshold and points back on the old side everywhere. The change starts where the
        run of high medians began, less the median's half window (the first slow points), and
        rests on every point since, at least ``hold``: it is confirmed as it is raised. A
        suspicion the mean raised and `_hold` cannot prove is confirmed the same way.
        Healthy streams and pending onsets only; a slow stream's further changes are the mean's.
        """
        c = self.config
        w = c.median_window
        pos = t[:, None] - (w - 1) + np.arange(w)
        cols = pos % self.hist
        valid = (pos >= self.born[rows][:, None]) & ~self.expected[rows[:, None], cols]
        med = masked_median(self.ring[rows[:, None], cols], valid)
        med = np.where(np.isnan(med), self.level[rows], med)
        pending = self.pending[rows] >= 0
        ref = np.where(pending, self.pending_ref[rows], self.healthy[rows])
        run = np.where(med > ref + math.log1p(c.rel), self.median_run[rows] + 1, 0)
        self.median_run[rows] = run
        cand = ((run >= c.median_run) & ~settling & ~expected & ~decided
                & (pending | ~self.slow[rows]))
        idx = np.flatnonzero(cand)
        idx = idx[[not pending[j] or self.states[int(rows[j])].pending_change == "onset"
                   for j in idx.tolist()]] if idx.size else idx
        if idx.size == 0:
            return
        r, now, ref = rows[idx], t[idx], ref[idx]
        y, ok = self._window(r, now, self.born[r])
        hpos = now[:, None] - (self.hist - 1) + np.arange(self.hist)
        before = ok & (hpos < (now - run[idx] + 1 - w // 2)[:, None])
        sigma = recent_noise(y, before, self.noise[r], floor=c.noise_floor)
        bar = ref + math.log1p(c.rel) + c.z * 1.2533 * sigma / math.sqrt(w)
        high = self._trailing_medians(r, hpos, y, ok) > bar[:, None]
        high &= hpos > (now - run[idx])[:, None]
        streak = np.cumprod(high[:, ::-1], axis=1).sum(axis=1)  # the newest ones in a row
        for j in np.flatnonzero(streak >= c.median_run).tolist():
            row, n = int(r[j]), int(now[j])
            index = n - int(streak[j]) + 1 - w // 2
            state = self.states[row]
            level = math.exp(float(med[idx[j]]))
            det: Detection | None
            if self.pending[row] >= 0:
                det = state.confirm(n, level)
                self.pending[row] = -1
            elif index > self.last_index[row]:
                det = state.judge(index=index, now=n, before_s=math.exp(float(ref[j])),
                                  after_s=level, rel=c.rel, hold=c.hold, points=n - index + 1)
                self.pending[row] = state.pending
                if det is None:
                    continue
                self._sync(row, index)
            else:
                continue
            out[row] = det

    def _trailing_medians(self, rows: npt.NDArray[np.intp], pos: npt.NDArray[np.int64],
                          y: FloatArray, valid: npt.NDArray[np.bool_]) -> FloatArray:
        """The trailing median `_median_path` took at each position of the rows' rings
        (``y``, ``valid``: `_window`'s, at positions ``pos``), read back from the ring rather
        than kept: ``-inf`` where the ring holds too few points before a position."""
        w = self.config.median_window
        wins = np.lib.stride_tricks.sliding_window_view(y, w, axis=1)
        keep = np.lib.stride_tricks.sliding_window_view(valid, w, axis=1)
        m, k = wins.shape[:2]
        med = masked_median(wins.reshape(m * k, w), keep.reshape(m * k, w)).reshape(m, k)
        level = self.levels[rows[:, None], pos[:, w - 1:] % self.hist]
        out = np.full(y.shape, -np.inf)
        out[:, w - 1:] = np.where(np.isnan(med), level, med)
        return out

    def restart(self, rows: npt.ArrayLike) -> None:
        """Streams whose source started over (a rank's process restarted: its iteration numbers
        went back). Their history is dropped and they warm up again, deciding nothing until
        their level settles; what they have decided (slow or not, against which levels) stays,
        so a slow job whose rank restarts is judged against the same healthy level afterwards.
        A healthy stream takes its settled level as its healthy one, as a new job does."""
        r = np.unique(np.asarray(rows, dtype=np.intp).reshape(-1))
        self.core.restart(r)
        self.born[r] = self.core.seen[r]
        self.last_index[r] = self.core.seen[r] - 1
        self.settling[r] = True
        self.noise[r] = self.config.noise_init
        self.expected[r] = False
        self.median_run[r] = 0

    def _settle(self, rows: npt.NDArray[np.intp], t: npt.NDArray[np.int64],
                settling: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
        """Which streams still warm up after this point. The first iterations of a job (and of
        a restarted rank) compile, fill caches and pipelines, and come faster or slower than
        what follows; they are no change point. A stream has settled once it has ``min_seen``
        points and the medians of its last two spans of ``settle`` points agree within half a
        threshold; a healthy one then takes that level as its healthy level."""
        c = self.config
        idx = np.flatnonzero(settling & (t - self.born[rows] + 1 >= max(c.min_seen,
                                                                        2 * c.settle)))
        if idx.size == 0:
            return settling
        r, now = rows[idx], t[idx]
        y, valid = self._window(r, now, self.born[r])
        steady = settled(y, valid, c.settle, math.log1p(c.rel / 2.0))
        if steady.any():
            done_rows, done_at = r[steady], now[steady]
            self.settling[done_rows] = False
            healthy = ~self.slow[done_rows]
            newest = valid[steady] & (np.arange(self.hist) >= self.hist - c.settle)
            level = masked_median(y[steady], newest)
            before, end = self._before_step(y[steady], valid[steady], now[steady], level)
            self.healthy[done_rows[healthy]] = np.minimum(level, before)[healthy]
            self.last_index[done_rows] = np.where(healthy & (before < level), end, done_at)
            settling = settling.copy()
            settling[idx[steady]] = False
        return settling

    def _before_step(self, y: FloatArray, valid: npt.NDArray[np.bool_],
                     now: npt.NDArray[np.int64], level: FloatArray
                     ) -> tuple[FloatArray, npt.NDArray[np.int64]]:
        """A step up inside the warm-up: per row, the level before it (``+inf`` when none) and
        the position of its last point.

        The warm-up settles on its newest points; a fail-slow that begins inside it (a fault
        from the job's first minute) would be learned as healthy, hiding itself and every later
        slowdown by the same amount. Recorded and generated warm-ups decay from slower to
        faster, so a warm-up's earlier points sit at or above the level it settles on; an
        earlier steady stretch a full threshold *below* it is the healthy level, and the rise
        since is judged as any slowdown is. Steady: two adjacent spans of ``settle`` points
        (expected bursts left out; medians, so a spike does not move them) whose medians agree
        within half a threshold, as the settling test itself asks; the newest such pair before
        the two the warm-up settled on wins (the level right before the step). A full
        threshold, not half: a warm-up's level wanders by a few percent as it settles, and
        only a step that would count as a slowdown after the warm-up counts inside it.

        A warm-up that alternates compiled and not yet compiled steps (the realistic
        generator's: steps of 0.15-0.2x among full ones, thinning out over ~100 iterations) has
        spans whose medians agree at the fast level; taken as the level before a step, it
        changed 5 of the 400 traces of its seed 4 (slowdowns raised inside three labelled
        warm-ups, an early fail-slow lost in one). It is told apart by its spread and its
        size. The stretch must be a level:
        three in four of its points within a threshold of its median (log-normal jitter of 5%
        keeps ~94% there; an alternation whose full steps are a quarter or more keeps under
        three in four); and the step must be one a fail-slow makes, at most 2x (half of
        ``spike`` in log). The paper's weak, medium and strong GPU fail-slows cost the job
        +20%, +52% and +95%; a first phase faster than the rest (a pipeline not yet full runs
        at about a third of its steady time) and those compiled steps (5-7x) are steps of 3x
        and more."""
        c = self.config
        span = c.settle
        rank = np.cumsum(valid[:, ::-1], axis=1)[:, ::-1]  # 1 for the newest valid point
        spans = int(valid.shape[1] // span)
        masks = [valid & (rank > k * span) & (rank <= (k + 1) * span) for k in range(spans)]
        meds = np.stack([masked_median(y, m) for m in masks], axis=1)
        full = np.stack([m.sum(axis=1) == span for m in masks], axis=1)
        before = np.full(y.shape[0], np.inf)
        end = now.copy()
        rise, tol = math.log1p(c.rel), math.log1p(c.rel / 2.0)
        for k in range(spans - 2, 1, -1):  # oldest first, so the newest pair wins
            pair = 0.5 * (meds[:, k] + meds[:, k + 1])
            both = masks[k] | masks[k + 1]
            near = (both & (np.abs(y - pair[:, None]) <= rise)).sum(axis=1)
            ok = (full[:, k] & full[:, k + 1] & (np.abs(meds[:, k] - meds[:, k + 1]) <= tol)
                  & (level - pair > rise) & (level - pair < 0.5 * math.log(c.spike))
                  & (4 * near >= 3 * 2 * span))
            before = np.where(ok, pair, before)
            # the newest point of span k: the column whose rank is k * span + 1
            col = np.argmax(valid & (rank == k * span + 1), axis=1)
            end = np.where(ok, now - (valid.shape[1] - 1 - col), end)
        return before, end

    def _window(self, rows: npt.NDArray[np.intp], now: npt.NDArray[np.int64],
                first: npt.NDArray[np.int64]) -> tuple[FloatArray, npt.NDArray[np.bool_]]:
        """Each row's ring as (m, hist), oldest first, and which points are from ``first`` on
        and not part of an expected burst."""
        pos = now[:, None] - (self.hist - 1) + np.arange(self.hist)
        y = self.ring[rows[:, None], pos % self.hist]
        valid = (pos >= first[:, None]) & ~self.expected[rows[:, None], pos % self.hist]
        return y, valid

    def _noise(self, rows: npt.NDArray[np.intp], now: npt.NDArray[np.int64]) -> FloatArray:
        """The jitter the verification judges against: `suspicion.recent_noise` over the ring
        since the stream (re)started."""
        y, valid = self._window(rows, now, self.born[rows])
        return recent_noise(y, valid, self.noise[rows], floor=self.config.noise_floor)

    def _hold(self, rows: npt.NDArray[np.intp], now: npt.NDArray[np.int64]
              ) -> list[Detection | None]:
        """The pending suspicions of ``rows`` that have had ``hold`` points: confirmed when the
        level held (`suspicion.held`); withdrawn when the newest ``hold`` points (spikes left
        out) sit confidently below the threshold, ``z`` standard errors of their mean, or when
        ``recent`` points have passed without the level holding (what cannot be proved within
        the detector's recent window is no clear fail-slow; it is raised again if it goes on);
        else left pending."""
        c = self.config
        out: list[Detection | None] = [None] * rows.shape[0]
        age = now - self.pending[rows] + 1
        due = np.flatnonzero(age >= c.hold)
        if due.size == 0:
            return out
        r, t = rows[due], now[due]
        ref = self.pending_ref[r]
        y, run = self._window(r, t, np.maximum(self.pending[r], self.born[r]))
        sigma = self._noise(r, t)
        test = held(y, run, ref, sigma, rel=c.rel, z=c.z, spike=c.spike, least=c.hold, share=3)
        kept = run & (y < ref[:, None] + math.log(c.spike))
        newest = kept & (np.cumsum(kept[:, ::-1], axis=1)[:, ::-1] <= c.hold)
        k = np.maximum(newest.sum(axis=1), 1)
        m = np.where(newest, y, 0.0).sum(axis=1) / k
        sd = np.sqrt(np.where(newest, (y - m[:, None]) ** 2, 0.0).sum(axis=1)
                     / np.maximum(k - 1, 1))
        below = m + c.z * np.maximum(sigma, sd) / np.sqrt(k) < ref + math.log1p(c.rel)
        back = (below & (k >= c.hold)) | (age[due] >= c.recent)
        for j in np.flatnonzero(test.ok | back).tolist():
            row, state = int(r[j]), self.states[int(r[j])]
            if test.ok[j]:
                det = state.confirm(int(t[j]), math.exp(float(test.level[j])))
            else:
                det = state.withdraw(int(t[j]), math.exp(float(m[j])))
                self._sync(row, int(t[j]))
            self.pending[row] = -1
            out[int(due[j])] = det
        return out

    def _sync(self, row: int, index: int) -> None:
        """A stream's decision moved its level at ``index``: the detector's view follows."""
        state = self.states[row]
        self.last_index[row] = index
        self.slow[row] = state.mode == SLOW
        self.ref[row] = math.log(state.slow_s) if state.mode == SLOW else 0.0

    def _plausible(self, rows: npt.NDArray[np.intp], t: npt.NDArray[np.int64],
                   ref: FloatArray, sigma: FloatArray) -> Any:
        """Vectorised pre-check: the mean of the last `confirm` points is half the threshold
        (plus its noise) away from the reference (healthy level, or the slow level while slow).

        Most candidates follow a spike that knocked the long run out and are plainly at the old
        level; dropping them here keeps the per-candidate Python work for the few real ones.
        """
        c = self.config
        cols = (t[:, None] - self._tail) % self.hist
        tail = self.ring[rows[:, None], cols]
        tail = np.minimum(tail, ref[:, None] + math.log(c.spike))
        gap = np.abs(tail.mean(axis=1) - ref) - sigma / math.sqrt(c.confirm)
        return gap >= 0.5 * math.log1p(c.rel)

    def _validate(self, rows: npt.NDArray[np.intp], now: npt.NDArray[np.int64],
                  lookback: npt.NDArray[np.int64], sigma: FloatArray) -> list[Detection | None]:
        """Verify the candidates of `rows` together, as (m, hist) arrays over each one's ring
        (oldest point first, the newest in the last column); Python only for the decisions."""
        c = self.config
        h = self.hist
        m = rows.shape[0]
        col = np.arange(h)
        pos = now[:, None] - (h - 1) + col                      # stream position of each column
        first = np.maximum(np.maximum(self.last_index[rows] + 1, now - h + 1), 0)
        lo = np.maximum(lookback, first)
        y = self.ring[rows[:, None], pos % h]
        valid = (pos >= first[:, None]) & ~self.expected[rows[:, None], pos % h]
        slow = self.slow[rows]
        enough = now - lo + 1 >= c.confirm
        # The start: a sign CUSUM over [lo, now] around a rough reference (see _split).
        rough, _ = self._reference(rows, slow, sigma, lo, first, pos, y, valid)
        index = self._split(lo, now, rough, pos, y, valid)
        ref, ref_var = self._reference(rows, slow, sigma, index, first, pos, y, valid)
        run = valid & (pos >= index[:, None])
        kept = run & (y < ref[:, None] + math.log(c.spike))
        n_run, n_kept = run.sum(axis=1), kept.sum(axis=1)
        # Mostly spikes: an evaluation or checkpoint burst, unless it lasts.
        spiky = n_kept < c.confirm
        lasting = spiky & (n_run >= c.spike_persist) & (2 * n_kept <= n_run)
        kept = np.where(lasting[:, None], run, kept)
        n = np.where(lasting, n_run, n_kept)
        ok = enough & (~spiky | lasting) & (n >= 1)
        nn = np.maximum(n, 1)
        a = np.where(kept, y, 0.0).sum(axis=1) / nn
        # Mean and spread of the log points, the spread never below the stream's jitter: an
        # intermittent slowdown is as uncertain as it looks, and four points that happen to
        # agree are not more certain than the stream's noise allows.
        ss = np.where(kept, (y - a[:, None]) ** 2, 0.0).sum(axis=1)
        sd = np.where(n > 1, np.sqrt(ss / np.maximum(n - 1, 1)), sigma)
        var = np.maximum(sigma, sd) ** 2 / nn + ref_var
        if c.validate and c.persist > 0:
            # Persistence: a level holds on (nearly) every point. A two-iteration transient
            # next to a stall, or an intermittent blip, leaves points back at the old level.
            mid = 0.5 * (a + ref)
            wrong = (kept & ((y < mid[:, None]) == (a > ref)[:, None])).sum(axis=1)
            ok &= wrong <= (n - 1) // c.persist
        rel = c.rel if c.validate else 0.0
        spread = np.exp(c.z * np.sqrt(var)) if c.validate else np.ones(m)
        move = a - ref
        # Python only where a decision can come out: a move beyond the threshold either way.
        look = ok & (np.abs(move) > math.log1p(rel / 2.0) + np.log(spread) - 1e-12)
        # The points the change rests on, for its stage: every point since its start but the
        # spikes it starts with (an evaluation step right before a burst is no point of it).
        lead = np.argmax(kept & run, axis=1) - np.argmax(run, axis=1)
        points = now - index + 1 - np.where(lasting, 0, lead)
        out: list[Detection | None] = [None] * m
        for j in np.flatnonzero(look).tolist():
            row = int(rows[j])
            state = self.states[row]
            k = int(index[j])
            was = (state.mode, state.slow_s)
            det = state.judge(index=k, now=int(now[j]), before_s=math.exp(ref[j]),
                              after_s=math.exp(a[j]), rel=rel, spread=float(spread[j]),
                              hold=c.hold if c.validate else 0, points=int(points[j]))
            self.pending[row] = state.pending
            if state.pending >= 0:
                self.pending_ref[row] = math.log(state.pending_before_s)
            if det is not None or (state.mode, state.slow_s) != was:
                # a decision, or a move absorbed into a pending suspicion: the level since
                # is measured from here
                self._sync(row, k)
            elif (state.mode == NORMAL
                  and move[j] + c.z * math.sqrt(var[j]) < -c.fall * math.log1p(rel)):
                # A confident large fall while healthy (the end of warm-up, a faster phase) is
                # a new baseline at once; a smaller one, such as the dip after a slowdown ends,
                # only moves the healthy level slowly, so the return from it is no slowdown.
                self.healthy[row] = a[j]
                self.last_index[row] = k
            out[j] = det
        return out

    def _reference(self, rows: npt.NDArray[np.intp], slow: npt.NDArray[np.bool_],
                   sigma: FloatArray, index: npt.NDArray[np.int64],
                   first: npt.NDArray[np.int64], pos: npt.NDArray[np.int64], y: FloatArray,
                   valid: npt.NDArray[np.bool_]) -> tuple[FloatArray, FloatArray]:
        """Log level a change at `index` is measured against, and the variance of that level.

        Healthy: the slow-moving healthy level (its variance from the points it has averaged).
        Slow: the median of the slow points before the change (since the last decision), or the
        level of that decision when too few are kept.
        """
        c = self.config
        jitter = (1.2533 * sigma) ** 2
        span = np.minimum(self.core.seen[rows], (2.0 - c.healthy_rate) / c.healthy_rate)
        ref = self.healthy[rows].copy()
        var = jitter / np.maximum(span, 1.0)
        if slow.any():
            s = np.flatnonzero(slow)
            lo = np.maximum(first[s], index[s] - c.before)
            mask = valid[s] & (pos[s] >= lo[:, None]) & (pos[s] < index[s, None])
            count = mask.sum(axis=1)
            some = count >= 2 * c.confirm
            med = masked_median(y[s], mask)
            ref[s] = np.where(some, med, self.ref[rows[s]])
            var[s] = np.where(some, jitter[s] / np.maximum(count, 1), 0.0)
        return ref, var

    def _split(self, lo: npt.NDArray[np.int64], now: npt.NDArray[np.int64], ref: FloatArray,
               pos: npt.NDArray[np.int64], y: FloatArray,
               valid: npt.NDArray[np.bool_]) -> npt.NDArray[np.int64]:
        """Where the newest stretch beyond the threshold begins.

        A sign CUSUM: the argmax over k of the count of points in [k, now] beyond the threshold
        (in the direction the last `confirm` points moved) minus the count of those that are not.
        Counting instead of summing keeps a lone stall just before a step from being taken as
        its start, and a mild elevation before a real step from being taken as part of it; ties
        go to the later k. An expected burst's points count for neither side.
        """
        c = self.config
        hi = now - c.confirm + 1
        tail = valid & (pos >= hi[:, None])
        med = masked_median(y, tail)
        up = np.where(tail.any(axis=1), med >= ref, True)
        d = np.where(up[:, None], y - ref[:, None], ref[:, None] - y)
        step = np.where(valid & (pos >= lo[:, None]),
                        np.where(d > math.log1p(c.rel), 1, -1), 0)
        acc = np.cumsum(step[:, ::-1], axis=1)[:, ::-1]          # sum over [k, now]
        allowed = (pos >= lo[:, None]) & (pos <= hi[:, None])
        score = np.where(allowed, acc, np.iinfo(np.int64).min)
        latest = score.shape[1] - 1 - np.argmax(score[:, ::-1], axis=1)
        out: npt.NDArray[np.int64] = np.where(hi > lo, pos[np.arange(pos.shape[0]), latest], lo)
        return out

    def state_dict(self) -> dict[str, Any]:
        c = self.config
        return {
            "config": {f: getattr(c, f) for f in c.__slots__},
            "core": self.core.state_dict(),
            "level": self.level.tolist(), "noise": self.noise.tolist(),
            "last": self.last.tolist(), "healthy": self.healthy.tolist(),
            "ref": self.ref.tolist(), "slow": self.slow.tolist(), "ring": self.ring.tolist(),
            "expected": np.argwhere(self.expected).tolist(), "bursts": self.bursts.state_dict(),
            "last_index": self.last_index.tolist(),
            "states": [s.to_json() for s in self.states],
            "born": self.born.tolist(), "settling": self.settling.tolist(),
            "pending": self.pending.tolist(), "pending_ref": self.pending_ref.tolist(),
            "median_run": self.median_run.tolist(),
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> BocdVBatch:
        config = BocdVConfig(**state["config"])
        core = BocdBatch.from_state(state["core"])
        out = cls(core.streams, params=core.params, config=config)
        out.core = core
        out.level = np.asarray(state["level"], dtype=np.float64)
        out.noise = np.asarray(state["noise"], dtype=np.float64)
        out.last = np.asarray(state["last"], dtype=np.float64)
        out.healthy = np.asarray(state["healthy"], dtype=np.float64)
        out.ref = np.asarray(state["ref"], dtype=np.float64)
        out.slow = np.asarray(state["slow"], dtype=bool)
        out.ring = np.asarray(state["ring"], dtype=np.float64).reshape(core.streams, out.hist)
        out.levels = _levels_of(out.ring, out.core.seen, config.level_points)
        at = np.asarray(state["expected"], dtype=np.int64).reshape(-1, 2)
        out.expected[at[:, 0], at[:, 1]] = True  # stored sparse: (stream, slot) pairs
        out.bursts = RecurringBursts.from_state(state["bursts"])
        out.last_index = np.asarray(state["last_index"], dtype=np.int64)
        out.states = [LevelState.from_json(s) for s in state["states"]]
        # Saved before warm-up and suspicions were kept: settled, nothing pending.
        n = core.streams
        out.born = np.asarray(state.get("born", [0] * n), dtype=np.int64)
        out.settling = np.asarray(state.get("settling", [False] * n), dtype=bool)
        out.pending = np.asarray(state.get("pending", [-1] * n), dtype=np.int64)
        out.pending_ref = np.asarray(state.get("pending_ref", [0.0] * n), dtype=np.float64)
        # Saved before the median path: no run of high medians under way.
        out.median_run = np.asarray(state.get("median_run", [0] * n), dtype=np.int64)
        return out


def _levels_of(ring: FloatArray, seen: npt.NDArray[np.int64], points: int) -> FloatArray:
    """The robust level at each slot of a restored ring (not saved: the ring has it), as the
    detector computed it: the median of that point and the ``points`` - 1 before it."""
    h = ring.shape[1]
    t = seen - 1  # the newest point's position
    pos = t[:, None] - (h - 1) + np.arange(h)  # position of each column, oldest first
    lag = np.arange(points)
    cols = (pos[:, :, None] - lag) % h
    rows = np.arange(ring.shape[0])[:, None, None]
    out: FloatArray = np.empty_like(ring)
    out[np.arange(ring.shape[0])[:, None], pos % h] = np.median(ring[rows, cols], axis=2)
    return out
