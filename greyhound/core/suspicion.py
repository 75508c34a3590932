"""BOCD+V's checks around a decision, vectorised over the streams that need one: has a job's
level settled (warm-up), how noisy is a stream now, and has a suspected slowdown held.

Each works on (m, hist) arrays of log iteration times as the detector's ring holds them
(oldest column first, the newest last) with a mask of the points that count, so the detector
calls them for the few streams concerned at once. Pure functions: arrays in, arrays out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]
IntArray = npt.NDArray[np.int64]

#: median |x_i - x_{i-1}| of independent N(0, s^2) points is 0.6745 * sqrt(2) * s.
_MAD_DIFF = 0.6745 * math.sqrt(2.0)


def masked_median(x: FloatArray, mask: BoolArray) -> FloatArray:
    """Row medians over the masked entries (NaN for a row with none), as numpy's median."""
    count = mask.sum(axis=1)
    srt = np.sort(np.where(mask, x, np.inf), axis=1)
    rows = np.arange(x.shape[0])
    lo = srt[rows, np.maximum((count - 1) // 2, 0)]
    hi = srt[rows, np.maximum(count // 2, 0)]
    out: FloatArray = np.where(count > 0, 0.5 * (lo + hi), np.nan)
    return out


def recent_noise(y: FloatArray, valid: BoolArray, fallback: FloatArray, *, floor: float,
                 least: int = 8) -> FloatArray:
    """Each row's jitter now: the median of its successive differences over the window, scaled
    to a standard deviation; ``fallback`` where fewer than ``least`` differences count.

    A running average of the differences stays inflated for dozens of iterations after a noisy
    stretch (flickering contention), and a 1.2x slowdown that starts right after it then looks
    no surer than the noise allows. The median over the window forgets the stretch once it fills
    less than half the window, and a step or a spike moves it by one difference or two.
    """
    both = valid[:, 1:] & valid[:, :-1]
    d = np.abs(y[:, 1:] - y[:, :-1])
    med = masked_median(d, both)
    out: FloatArray = np.where(both.sum(axis=1) >= least, med / _MAD_DIFF, fallback)
    return np.maximum(out, floor)


def settled(y: FloatArray, valid: BoolArray, span: int, tolerance: float) -> BoolArray:
    """Rows whose level has settled: the median of the newest ``span`` valid points and that of
    the ``span`` before differ by at most ``tolerance`` (log). Rows with fewer than 2 x span
    valid points have not."""
    rank = np.cumsum(valid[:, ::-1], axis=1)[:, ::-1]  # 1 for the newest valid point
    newer = valid & (rank <= span)
    older = valid & (rank > span) & (rank <= 2 * span)
    enough = valid.sum(axis=1) >= 2 * span
    gap = np.abs(masked_median(y, newer) - masked_median(y, older))
    out: BoolArray = enough & (np.nan_to_num(gap, nan=np.inf) <= tolerance)
    return out


@dataclass(frozen=True, slots=True)
class Held:
    """Per row: whether the suspected slowdown held, and its mean log level since its start."""

    ok: BoolArray
    level: FloatArray


def held(y: FloatArray, run: BoolArray, ref: FloatArray, sigma: FloatArray, *, rel: float,
         z: float, spike: float, least: int, share: int) -> Held:
    """Has the level since each row's suspected start held the slowdown?

    ``run`` marks the points since the start (expected bursts left out), ``ref`` is the log level
    the slowdown was measured against. Spikes (above ``spike`` x the reference) are left out,
    unless they are most of the run: a sustained huge slowdown is all spikes. A level holds when:

    - ``least`` points sit at it: within ``z``+1 robust spreads (the median absolute deviation,
      never below ``sigma``) of the run's median. A stall next to a burst is a point above the
      old level but off the burst's, and must not make a 4-iteration burst a 5-iteration level;
    - its mean clears ``rel`` by ``z`` standard errors, the spread never below the stream's
      jitter ``sigma`` (the test the suspicion passed, on every point since);
    - at most one point in ``share`` sits back on the old side of the midpoint: contention that
      flickers holds its level on two iterations of three, and is a fail-slow by the labels;
    - none of the newest ``least`` // 2 points is back: a transient that has ended shows its end
      there, while a fail-slow's rare dip is forgiven once the level has held past it;
    - the newest point is not leaving the level (``z`` spreads below the mean of the others),
      as the last iteration of a burst that is already easing does.
    """
    kept = run & (y < ref[:, None] + math.log(spike))
    n_run, n_kept = run.sum(axis=1), kept.sum(axis=1)
    spiky = (n_kept < least) & (2 * n_kept <= n_run)
    kept = np.where(spiky[:, None], run, kept)
    n = np.where(spiky, n_run, n_kept)
    nn = np.maximum(n, 1)
    a = np.where(kept, y, 0.0).sum(axis=1) / nn
    ss = np.where(kept, (y - a[:, None]) ** 2, 0.0).sum(axis=1)
    sd = np.where(n > 1, np.sqrt(ss / np.maximum(n - 1, 1)), sigma)
    se = np.maximum(sigma, sd) / np.sqrt(nn)
    med = masked_median(y, kept)
    mad = 1.4826 * masked_median(np.abs(y - med[:, None]), kept)
    spread = np.maximum(sigma, np.nan_to_num(mad))
    at_level = kept & (np.abs(y - med[:, None]) <= (z + 1.0) * spread[:, None])
    back = kept & (y < 0.5 * (a + ref)[:, None])
    recent = kept & (np.cumsum(kept[:, ::-1], axis=1)[:, ::-1] <= least // 2)
    ok = ((at_level.sum(axis=1) >= least) & (a - ref > math.log1p(rel) + z * se)
          & (back.sum(axis=1) <= n // share) & ~(back & recent).any(axis=1))
    # the newest point counted, against the mean and spread of the others
    rows = np.arange(kept.shape[0])
    newest = kept.shape[1] - 1 - np.argmax(kept[:, ::-1], axis=1)
    others = kept.copy()
    others[rows, newest] = False
    m = np.maximum(others.sum(axis=1), 1)
    a0 = np.where(others, y, 0.0).sum(axis=1) / m
    sd0 = np.sqrt(np.where(others, (y - a0[:, None]) ** 2, 0.0).sum(axis=1)
                  / np.maximum(m - 1, 1))
    ok &= y[rows, newest] >= a0 - z * np.maximum(sigma, sd0)
    return Held(ok, a)
