"""Truncated Bayesian online change-point detection (Adams & MacKay 2007), batched over streams.

One numpy step updates R independent streams at once, because the tracker sees every rank of a
job per iteration and a Python call per rank would cost more than the arithmetic. The model:

- observations are log iteration times, so a fail-slow of factor f is an additive step log(f)
  whatever the job's own iteration time;
- Normal-Gamma conjugate prior per run, Student-t posterior predictive, constant hazard h;
- the run-length posterior is truncated to W slots: slot k (k < W-1) is "the current run holds the
  last k+1 points"; the last slot is the long run, whose sufficient statistics decay with factor
  `decay` so it follows slow drift instead of averaging the whole job;
- the degrees of freedom of the predictive are capped (`nu_cap`): a single GC pause or checkpoint
  iteration then costs the long run a bounded log-likelihood instead of killing it, which keeps
  one outlier from looking like a change point;
- the prior mean and scale are per stream (`mu0`, `sigma0`) so that a new run is judged against
  the stream's own noise level from its first points.

Cost per step is O(R * W); the state is a handful of (R, W) float arrays.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from greyhound.core.detector import NORMAL, Detection, LevelState

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
        first = self.seen[sel] == 0
        if first.any():
            new[first] = LOG_FLOOR
            new[first, 0] = 0.0
        if rows is None:
            self.logp, self.n, self.s1, self.s2 = new, nn, ns1, ns2
            self.seen += 1
        else:
            self.logp[rows], self.n[rows], self.s1[rows], self.s2[rows] = new, nn, ns1, ns2
            self.seen[rows] += 1
        return new

    def state_dict(self) -> dict[str, Any]:
        p = self.params
        return {
            "params": {"window": p.window, "hazard": p.hazard, "kappa0": p.kappa0,
                       "alpha0": p.alpha0, "nu_cap": p.nu_cap, "decay": p.decay},
            "logp": self.logp.tolist(), "n": self.n.tolist(),
            "s1": self.s1.tolist(), "s2": self.s2.tolist(), "seen": self.seen.tolist(),
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
        return out


@dataclass(frozen=True, slots=True)
class BocdVConfig:
    """Decision constants of BOCD+V on top of the BOCD posterior.

    The paper's rule P(r_t = 0) > 0.9 cannot be used as such: under a constant hazard the mass on
    r = 0 is h * p0(x) / evidence, which is large for any single outlier and small for a real but
    modest step whose first point is still plausible under the old run. We instead ask, after
    every point, whether the posterior puts more than `threshold` of its mass on a run that
    started within the last `recent` points, and whether the most probable run already holds
    `confirm` points (so a lone spike, whose run is one point long, is never reported). Four,
    not three: on hostile traces a two-iteration transient (or a checkpoint and the slow
    iteration after it) next to an unrelated GC or loader spike gives three elevated points
    often enough to cost ~9% job-level FPR, while the fourth point costs one iteration of
    latency (median 3). The
    validation then compares robust levels (medians, in seconds) of the points since the change
    against the `before` points preceding it and reports only a difference of >= `rel`.
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
    min_seen: int = 12



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
        self.streams = streams
        self.level = np.zeros(streams)
        self.noise = np.full(streams, c.noise_init)
        self.last = np.zeros(streams)
        self.hist = c.recent + c.before
        self.ring = np.zeros((streams, self.hist))
        self.last_index = np.full(streams, -1, dtype=np.int64)
        self.states = [LevelState() for _ in range(streams)]
        self._all = np.arange(streams)
        self._lag = np.arange(self.config.level_points)
        self._tail = np.arange(self.config.confirm - 1, -1, -1)

    def update_many(self, values: npt.ArrayLike) -> list[Detection | None]:
        """One iteration time (seconds) per stream; NaN (or <= 0) skips that stream this time."""
        x = np.asarray(values, dtype=np.float64).reshape(-1)
        if x.shape[0] != self.streams:
            raise ValueError(f"expected {self.streams} values, got {x.shape[0]}")
        ok = np.isfinite(x) & (x > 0.0)
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
        fresh = seen == 0
        if fresh.any():
            # A new stream starts with its first value as history, so medians are defined.
            self.ring[rr[fresh]] = xs[fresh, None]
            self.level[rr[fresh]] = y[fresh]
            self.last[rr[fresh]] = y[fresh]
        noise = self.noise[sel]
        logp = self.core.step(y, self.level[sel], noise, rows)
        # Noise scale from successive differences (immune to level steps), clipped so a spike
        # moves it by a bounded amount; the prior mean of a new run is the median of the last
        # few points, which follows warm-up and drift but not a single spike.
        d = np.minimum(np.abs(y - self.last[sel]) / 1.128, 4.0 * noise)
        self.noise[sel] = np.maximum(noise + c.noise_rate * (d - noise), c.noise_floor)
        self.last[sel] = y
        t = seen  # position of this point in its stream
        self.ring[rr, t % self.hist] = xs
        cols = (t[:, None] - self._lag) % self.hist
        self.level[sel] = np.log(np.median(self.ring[rr[:, None], cols], axis=1))
        kmap = logp.argmax(axis=1)
        start = t - kmap
        cand = ((kmap >= c.confirm - 1) & (kmap < c.recent) & (t >= c.min_seen)
                & (start > self.last_index[sel]))
        if not cand.any():
            return out
        idx = np.flatnonzero(cand)
        idx = idx[np.exp(logp[idx, : c.recent]).sum(axis=1) > c.threshold]
        if c.validate and idx.size:
            idx = idx[self._plausible(rr[idx], t[idx])]
        for j in idx.tolist():
            row = int(rr[j])
            out[row] = self._validate(row, int(t[j]), int(start[j]))
        return out

    def _plausible(self, rows: npt.NDArray[np.intp], t: npt.NDArray[np.int64]) -> Any:
        """Vectorised pre-check of the validation, against the long run's mean as the old level.

        Most candidates follow a spike that knocked the long run out and are plainly at the old
        level; dropping them here keeps the per-candidate Python work for the few real ones.
        """
        c = self.config
        cols = (t[:, None] - self._tail) % self.hist
        tail = np.log(self.ring[rows[:, None], cols])
        n = self.core.n[rows, -1]
        old = np.where(n > 0.0, self.core.s1[rows, -1] / np.maximum(n, 1e-12), tail[:, 0])
        med = np.median(tail, axis=1)
        diff = med - old
        mid = old + 0.5 * diff
        up = (diff >= 0.5 * math.log1p(c.rel)) & (tail.min(axis=1) > mid)
        down = (diff <= -0.5 * math.log1p(c.rel)) & (tail.max(axis=1) < mid)
        return up | down

    def _validate(self, row: int, now: int, index: int) -> Detection | None:
        if index <= self.last_index[row]:
            return None
        c = self.config
        lo = max(0, index - c.before)
        if index - lo < c.confirm:
            return None
        # Small Python lists beat numpy here: a candidate touches at most `hist` values.
        h = self.hist
        ring = self.ring[row].tolist()
        run = [ring[i % h] for i in range(index, now + 1)]
        after = _median(run)
        before = _median([ring[i % h] for i in range(lo, index)])
        state = self.states[row]
        if c.validate:
            # The last `confirm` points must all sit nearer (in log) the new level than the old
            # one: a spike followed by a slow iteration, or a two-iteration transient, fails.
            mid = math.sqrt(after * before)
            tail = run[-c.confirm:]
            if (after > before and min(tail) <= mid) or (after < before and max(tail) >= mid):
                return None
        rel = c.rel if c.validate else 0.0
        det = state.judge(index=index, now=now, before_s=before, after_s=after, rel=rel)
        if det is not None or (state.mode == NORMAL and after < before):
            self.last_index[row] = index
        return det

    def state_dict(self) -> dict[str, Any]:
        c = self.config
        return {
            "config": {f: getattr(c, f) for f in c.__slots__},
            "core": self.core.state_dict(),
            "level": self.level.tolist(), "noise": self.noise.tolist(),
            "last": self.last.tolist(), "ring": self.ring.tolist(),
            "last_index": self.last_index.tolist(),
            "states": [s.to_json() for s in self.states],
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
        out.ring = np.asarray(state["ring"], dtype=np.float64).reshape(core.streams, out.hist)
        out.last_index = np.asarray(state["last_index"], dtype=np.int64)
        out.states = [LevelState.from_json(s) for s in state["states"]]
        return out


def _median(values: list[float]) -> float:
    v = sorted(values)
    m = len(v) // 2
    return v[m] if len(v) % 2 else 0.5 * (v[m - 1] + v[m])
