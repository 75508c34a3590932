"""Seeded generator of labelled iteration-time traces as hostile as real training jobs.

Healthy behaviour (all labelled as noise, never as a fail-slow): start-up compilation and warm-up,
slow drift, sequence-length jitter (Gaussian or heavy-tailed), periodic Python GC pauses,
allocator and data-loader spikes, checkpoint saves (optionally with a slow iteration after),
evaluation phases, persistent steps under 10%, long transients under 10% (and under 10% stacked:
``_under_10``), short transients of one
or two iterations of any size, and, in one job in ten, contention bursts of 3-4 iterations at
1.3-2.5x (another job's burst on the link, a CPU-hungry neighbour): as strong as a fail-slow
while they last, but shorter than the 8 iterations one lasts at least. Length and rate follow
what traces from outside the project showed: a detector that flagged every such burst flagged
2 of 214 healthy jobs there, each time on a 4-iteration one.

Fail-slows: factor 1.12x..3x (log-uniform), lasting 8 iterations to the rest of the job (hours),
abrupt or ramping over 5-40 iterations, and compound (a second slowdown on top of the first, as
congestion on top of throttling). Ground truth is returned with the times, as in ruptures'
`pw_constant`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from greyhound.core.arrays import FloatArray
from greyhound.traces.labels import Episode, NoiseEvent, Trace


@dataclass(frozen=True, slots=True)
class GeneratorConfig:
    min_len: int = 1500
    max_len: int = 8000
    positive_share: float = 0.5
    min_factor: float = 1.12
    max_factor: float = 3.0
    min_jitter: float = 0.005
    max_jitter: float = 0.04


def log_uniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    """A draw whose logarithm is uniform: factors and durations spread evenly across scales."""
    return float(np.exp(rng.uniform(np.log(lo), np.log(hi))))


def _healthy(rng: np.random.Generator, n: int, cfg: GeneratorConfig,
             noise: list[NoiseEvent]) -> FloatArray:
    """Multiplicative healthy profile (1.0 = the job's nominal iteration time)."""
    t = np.arange(n, dtype=np.float64)
    sigma = log_uniform(rng, cfg.min_jitter, cfg.max_jitter)
    heavy = rng.random() < 0.3  # sequence-length jitter, sometimes heavy-tailed
    logf = (rng.standard_t(4.0, n) / np.sqrt(2.0) if heavy else rng.normal(0.0, 1.0, n)) * sigma
    # Compilation on the first iteration and a warm-up that decays.
    warm = int(rng.integers(5, 80))
    logf += np.log(rng.uniform(1.3, 3.0)) * np.exp(-t / (warm / 3.0))
    logf[0] += np.log(rng.uniform(5.0, 50.0))
    noise.append(NoiseEvent("warmup", 0, warm, 1.0))
    if rng.random() < 0.6:  # slow drift, up to +-12% over the job
        drift = rng.uniform(-0.12, 0.12)
        logf += drift * t / n
        noise.append(NoiseEvent("drift", 0, n, float(np.exp(drift))))
    f: FloatArray = np.exp(logf)
    gc_period = int(rng.integers(15, 200))
    for i in range(gc_period, n, gc_period):
        j = min(n - 1, i + int(rng.integers(-2, 3)))
        f[j] *= rng.uniform(1.1, 2.0)
    noise.append(NoiseEvent("gc", gc_period, n, 0.0))
    for kind, p, lo, hi in (("allocator", 0.008, 1.1, 1.6), ("dataloader", 0.006, 1.5, 5.0)):
        hits = np.flatnonzero(rng.random(n) < rng.uniform(0.0, p))
        f[hits] *= rng.uniform(lo, hi, hits.size)
        noise.extend(NoiseEvent(kind, int(h), int(h) + 1, 0.0) for h in hits[:20])
    every = int(rng.integers(200, 2000))
    for i in range(every, n, every):
        f[i] *= rng.uniform(5.0, 60.0)
        if rng.random() < 0.5 and i + 1 < n:
            f[i + 1] *= rng.uniform(1.1, 1.5)
        noise.append(NoiseEvent("checkpoint", i, i + 2, 0.0))
    every = int(rng.integers(100, 1000))
    for i in range(every // 2, n, every):
        f[i] *= rng.uniform(2.0, 10.0)
        noise.append(NoiseEvent("eval", i, i + 1, 0.0))
    level = np.ones(n)  # the steps' and long transients' product: kept under 10% a rise
    for _ in range(int(rng.integers(0, 3))):  # persistent steps under 10%
        s = int(rng.integers(100, n))
        fac = _under_10(level, s, n, 1.0 + float(rng.choice([-1.0, 1.0]) *
                                                 rng.uniform(0.02, 0.07)))
        f[s:] *= fac
        noise.append(NoiseEvent("step<10%", s, n, fac))
    for _ in range(int(rng.integers(0, 4))):  # long transients under 10%
        s = int(rng.integers(100, n))
        e = min(n, s + int(rng.integers(5, 300)))
        fac = _under_10(level, s, e, float(rng.uniform(1.02, 1.07)))
        f[s:e] *= fac
        noise.append(NoiseEvent("transient<10%", s, e, fac))
    for _ in range(int(rng.integers(0, 6))):  # short transients: one or two iterations
        s = int(rng.integers(100, n - 2))
        e = s + int(rng.integers(1, 3))
        fac = rng.uniform(1.2, 3.0)
        f[s:e] *= fac
        noise.append(NoiseEvent("transient<=2it", s, e, float(fac)))
    bursts = int(rng.integers(1, 4)) if rng.random() < 0.1 else 0
    for _ in range(bursts):  # contention bursts: 3 or 4 iterations
        s = int(rng.integers(100, n - 4))
        e = s + int(rng.integers(3, 5))
        fac = log_uniform(rng, 1.3, 2.5)
        f[s:e] *= fac
        noise.append(NoiseEvent("burst3-4it", s, e, fac))
    return f


STACK_WINDOW = 100  # iterations within which two disturbances read as one change
STACK_MAX = 1.09  # what stacked noise may rise by there: under 10%, below the 1.12x of a fail-slow


def _under_10(level: FloatArray, start: int, end: int, factor: float) -> float:
    """``factor`` for [start, end), shrunk (towards 1, on a log scale) until no iteration's
    noise level rises more than STACK_MAX above its lowest over the STACK_WINDOW before it;
    ``level`` takes it.

    Each persistent step and long transient is under 10%, but two drawn a few iterations apart
    (or a step down then one up) made one rise of 11-15% that holds for hundreds of iterations:
    by this generator's own definition a fail-slow (>= 1.12x, >= 8 iterations), labelled noise.
    No detector can call both it and a 1.12x episode right; the cap keeps the label true."""
    def worst(k: float) -> float:
        trial = level.copy()
        trial[start:end] *= k
        lo, hi = max(0, start - STACK_WINDOW), min(len(trial), end + STACK_WINDOW)
        seg = trial[lo:hi]
        floor = np.array([seg[max(0, i - STACK_WINDOW):i + 1].min() for i in range(seg.size)])
        return float((seg / floor).max())

    k = factor
    for _ in range(20):
        if worst(k) <= STACK_MAX:
            break
        k = float(np.exp(np.log(k) * 0.8))
    else:
        k = 1.0
    level[start:end] *= k
    return k


def _duration(rng: np.random.Generator, room: int) -> int:
    u = rng.random()
    if u < 0.3:
        d = int(rng.integers(8, 30))
    elif u < 0.7:
        d = int(rng.integers(30, 300))
    else:
        d = int(rng.integers(300, max(301, room)))
    return max(8, min(d, room))


def _apply(f: FloatArray, rng: np.random.Generator, start: int, end: int,
           factor: float) -> Episode:
    """Slow [start, end) by factor, abruptly or with a ramp; returns the labelled episode."""
    ramp = int(rng.integers(5, 41)) if rng.random() < 0.3 and end - start > 60 else 0
    prof = np.full(end - start, factor)
    if ramp:
        k = np.arange(1, min(ramp, end - start) + 1, dtype=np.float64)
        prof[: k.size] = np.exp(np.log(factor) * k / ramp)
    f[start:end] *= prof
    onset = start + int(np.argmax(prof >= 1.10))
    return Episode(start, end, float(factor), onset)


def generate_trace(rng: np.random.Generator, name: str, *, positive: bool,
                   cfg: GeneratorConfig | None = None) -> Trace:
    cfg = cfg or GeneratorConfig()
    n = int(rng.integers(cfg.min_len, cfg.max_len + 1))
    noise: list[NoiseEvent] = []
    f = _healthy(rng, n, cfg, noise)
    episodes: list[Episode] = []
    if positive:
        cursor = int(rng.integers(150, max(151, n // 3)))
        for _ in range(int(rng.integers(1, 4))):
            if cursor + 8 > n:
                break
            end = cursor + _duration(rng, n - cursor)
            factor = log_uniform(rng, cfg.min_factor, cfg.max_factor)
            episodes.append(_apply(f, rng, cursor, end, factor))
            if rng.random() < 0.2 and end - cursor > 60:  # compound: a second one on top
                s2 = cursor + int(rng.integers(30, end - cursor - 20))
                e2 = s2 + _duration(rng, end - s2)
                episodes.append(_apply(f, rng, s2, e2, log_uniform(rng, cfg.min_factor, 2.0)))
            cursor = end + int(rng.integers(100, 1000))
    base = log_uniform(rng, 0.02, 5.0)
    episodes.sort(key=lambda e: e.start)
    return Trace(name, base * f, episodes, noise)


def generate_traces(count: int = 400, seed: int = 0,
                    cfg: GeneratorConfig | None = None) -> list[Trace]:
    """`count` traces, about `positive_share` of them with at least one fail-slow."""
    cfg = cfg or GeneratorConfig()
    rng = np.random.default_rng(seed)
    return [generate_trace(rng, f"synth-{i:04d}", positive=bool(rng.random() < cfg.positive_share),
                           cfg=cfg) for i in range(count)]
