"""Seeded generator of iteration times with the noise of a real training run, labelled by hindsight.

Built after what recorded traces of a real run on one GPU show (about 5% iteration-to-iteration
jitter, heavy spikes, a healthy level that wanders by a few percent between plateaus), so that a
detector can be tuned on thousands of such traces instead of the two recorded ones:

- a healthy level ``t0 * h`` where ``h`` holds plateaus of 100-600 iterations around 0.97
  (0.90-1.05), with jitter of 2.5-7% per plateau, sometimes heavy-tailed;
- warm-up: a decaying start, or the alternation of compiled and not yet compiled steps;
- periodic evaluation spikes (x5-30, now and then a short burst after them) and rarer periodic
  checkpoints (x10-60, sometimes one slow iteration after);
- garbage-collection and data-loader stalls at random (x1.3-8, now and then two or three in a
  row), and short slow runs of 3-7 iterations;
- intermittent slowdowns of x1.15-2.2 lasting 10-600 iterations, steady (another process on the
  GPU), fluctuating (CPU contention) or bursty (on and off), a few just under the threshold;
- aftermath stretches of x1.15-1.3 after some slowdowns, dips of x0.88-0.95 after some (the
  level comes back from below), mild sub-threshold elevations, and contention flicker (every
  other iteration or so x1.12-1.25 for 8-40 iterations).

The ground truth is not the injected factors but `hindsight.label_by_hindsight` on the realised
trace, the rules the recorded traces were labelled with; the injected disturbances are kept as
`NoiseEvent`s for error analysis.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from greyhound.core.arrays import FloatArray
from greyhound.traces.generator import log_uniform
from greyhound.traces.hindsight import label_by_hindsight
from greyhound.traces.labels import NoiseEvent, Trace

ONSET_TOLERANCE = 6


@dataclass(frozen=True, slots=True)
class RealisticConfig:
    min_len: int = 2000
    max_len: int = 6000
    positive_share: float = 0.7
    min_factor: float = 1.15
    max_factor: float = 2.2


def _healthy(rng: np.random.Generator, n: int, noise: list[NoiseEvent]) -> FloatArray:
    """Log of the healthy profile: plateaus, per-plateau jitter, smooth moves between them."""
    level = np.empty(n)
    sigma = np.empty(n)
    i = 0
    prev = float(np.log(0.97))
    while i < n:
        length = int(rng.integers(100, 601))
        target = float(np.log(np.clip(rng.normal(0.97, 0.03), 0.90, 1.05)))
        seg = slice(i, min(n, i + length))
        k = np.arange(seg.stop - seg.start, dtype=np.float64)
        ramp = float(rng.integers(5, 40))
        level[seg] = target + (prev - target) * np.exp(-k / ramp)
        sigma[seg] = log_uniform(rng, 0.025, 0.07)
        noise.append(NoiseEvent("plateau", seg.start, seg.stop, float(np.exp(target))))
        prev = target
        i = seg.stop
    z = rng.standard_t(5.0, n) / np.sqrt(5.0 / 3.0) if rng.random() < 0.4 else rng.normal(size=n)
    out: FloatArray = level + sigma * z
    return out


def _warmup(rng: np.random.Generator, logf: FloatArray, noise: list[NoiseEvent]) -> int:
    n = logf.shape[0]
    w = int(rng.integers(0, 151))
    if w == 0:
        return 0
    t = np.arange(w, dtype=np.float64)
    if rng.random() < 0.5:
        logf[:w] += np.log(rng.uniform(1.3, 3.0)) * np.exp(-t / (w / 3.0))
    else:  # steps not yet compiled alternate with compiled ones
        hits = np.flatnonzero(rng.random(w) < rng.uniform(0.3, 0.7))
        logf[hits] += np.log(rng.uniform(5.0, 8.0, hits.size))
    logf[0] += np.log(rng.uniform(5.0, 50.0))
    noise.append(NoiseEvent("warmup", 0, min(n, w), 1.0))
    return w


def _periodic(rng: np.random.Generator, logf: FloatArray, w: int,
              noise: list[NoiseEvent]) -> None:
    n = logf.shape[0]
    period = int(rng.integers(50, 251))
    for i in range(w + int(rng.integers(0, period)), n, period):
        logf[i] += np.log(rng.uniform(5.0, 30.0))
        end = i + 1
        if rng.random() < 0.15:  # an evaluation that takes a few iterations
            end = min(n, i + 1 + int(rng.integers(1, 4)))
            logf[i + 1:end] += np.log(rng.uniform(2.0, 8.0))
        noise.append(NoiseEvent("eval", i, end, 0.0))
    every = int(rng.integers(300, 2001))
    for i in range(w + every, n, every):
        logf[i] += np.log(rng.uniform(10.0, 60.0))
        if rng.random() < 0.5 and i + 1 < n:
            logf[i + 1] += np.log(rng.uniform(1.1, 1.5))
        noise.append(NoiseEvent("checkpoint", i, min(n, i + 2), 0.0))


def _stalls(rng: np.random.Generator, logf: FloatArray, w: int,
            noise: list[NoiseEvent]) -> None:
    n = logf.shape[0]
    rate = rng.uniform(0.005, 0.03)
    for i in np.flatnonzero(rng.random(n - w) < rate) + w:
        end = min(n, int(i) + (1 if rng.random() < 0.9 else int(rng.integers(2, 4))))
        logf[i:end] += np.log(log_uniform(rng, 1.3, 8.0))
        noise.append(NoiseEvent("stall", int(i), end, 0.0))
    for _ in range(int(rng.integers(0, 6))):
        s = int(rng.integers(w, n - 8))
        e = s + int(rng.integers(3, 8))
        f = log_uniform(rng, 1.15, 2.0)
        logf[s:e] += np.log(f)
        noise.append(NoiseEvent("short-run", s, e, f))
    for _ in range(int(rng.integers(0, 5))):
        s = int(rng.integers(w, n - 10))
        e = min(n, s + int(rng.integers(10, 151)))
        f = rng.uniform(1.03, 1.10)
        logf[s:e] += np.log(f)
        noise.append(NoiseEvent("mild", s, e, float(f)))
    for _ in range(int(rng.integers(0, 4))):  # contention flicker: every other iteration slow
        s = int(rng.integers(w, n - 45))
        e = s + int(rng.integers(8, 41))
        f = rng.uniform(1.12, 1.25)
        hits = np.flatnonzero(rng.random(e - s) < rng.uniform(0.3, 0.6)) + s
        logf[hits] += np.log(f)
        noise.append(NoiseEvent("flicker", s, e, float(f)))


def _slowdown(rng: np.random.Generator, n: int, s: int, cfg: RealisticConfig
              ) -> tuple[int, FloatArray, str, float]:
    """Log factors of one intermittent slowdown starting at s: (end, factors, pattern, factor)."""
    length = int(np.clip(log_uniform(rng, 10.0, 600.0), 10, n - s))
    f = log_uniform(rng, cfg.min_factor, cfg.max_factor)
    if rng.random() < 0.1:
        f = rng.uniform(1.10, cfg.min_factor)  # just under: the labels will ignore it
    u = rng.random()
    if u < 0.4:
        pattern = "steady"
        prof = np.full(length, np.log(f)) + rng.normal(0.0, 0.02, length)
    elif u < 0.8:
        pattern = "fluctuating"
        lo = 1.0 + (f - 1.0) * rng.uniform(0.2, 0.7)
        prof = np.log(rng.uniform(lo, 2.0 * f - lo, length).clip(1.0))
    else:
        pattern = "bursty"
        prof = np.zeros(length)
        i = 0
        on = True
        while i < length:
            d = int(rng.integers(5, 40) if on else rng.integers(2, 8))
            if on:
                prof[i:i + d] = np.log(f)
            on = not on
            i += d
        prof[:5] = np.log(f)
    return s + length, prof, pattern, f


def generate_realistic(rng: np.random.Generator, name: str, *, positive: bool,
                       cfg: RealisticConfig | None = None) -> Trace:
    cfg = cfg or RealisticConfig()
    n = int(rng.integers(cfg.min_len, cfg.max_len + 1))
    noise: list[NoiseEvent] = []
    logf = _healthy(rng, n, noise)
    w = _warmup(rng, logf, noise)
    _periodic(rng, logf, w, noise)
    _stalls(rng, logf, w, noise)
    if positive:
        cursor = w + int(rng.integers(100, max(101, n // 3)))
        for _ in range(int(rng.integers(1, 6))):
            if cursor + 10 > n:
                break
            end, prof, pattern, f = _slowdown(rng, n, cursor, cfg)
            logf[cursor:end] += prof
            noise.append(NoiseEvent(f"slow-{pattern}", cursor, end, f))
            if rng.random() < 0.4 and end + 20 < n:
                tail = min(n, end + int(rng.integers(20, 101)))
                a = rng.uniform(1.15, 1.3)
                logf[end:tail] += np.log(a)
                noise.append(NoiseEvent("aftermath", end, tail, float(a)))
                end = tail
            if rng.random() < 0.4 and end + 30 < n:  # a dip after it, then back to normal
                tail = min(n, end + int(rng.integers(30, 151)))
                a = rng.uniform(0.88, 0.95)
                logf[end:tail] += np.log(a)
                noise.append(NoiseEvent("dip", end, tail, float(a)))
                end = tail
            # the next one may begin soon after (the labels keep two apart from 30 on), while
            # the level is still noisy from this one
            cursor = end + int(rng.integers(30, 800))
    t0 = log_uniform(rng, 0.01, 2.0)
    times = t0 * np.exp(logf)
    episodes, ignore = label_by_hindsight(times, t0, warmup=w)
    return Trace(name, times, episodes, noise, ignore, t0, ONSET_TOLERANCE)


def generate_realistic_traces(count: int = 200, seed: int = 0,
                              cfg: RealisticConfig | None = None) -> list[Trace]:
    """`count` traces, about `positive_share` of them with injected slowdowns."""
    cfg = cfg or RealisticConfig()
    rng = np.random.default_rng(seed)
    return [generate_realistic(rng, f"real-like-{i:04d}", positive=bool(rng.random()
                                                                        < cfg.positive_share),
                               cfg=cfg) for i in range(count)]
