"""Labels by hindsight: the rules the recorded traces were labelled with, as a function.

Whoever labels a recorded trace sees all of it and knows its healthy iteration time ``t0``. A
fail-slow episode is a run of at least ``min_len`` iterations whose centred 9-iteration median is
above ``slow`` x t0 (runs closer than ``merge`` iterations merged), and whose own median is at
least ``episode`` x t0. Stretches that are neither to be found nor to be avoided are ignored:
warm-up, runs of 3 to ``min_len - 1`` slow iterations, runs of 3 or more iterations whose
centred median lies between ``near`` and ``slow`` x t0, and would-be episodes whose median lies
between ``borderline`` and ``episode`` x t0 (too close to a 10% threshold to demand either way).

The realistic generator labels its traces with this function, so that they are scored exactly
as the recorded ones are, and the two kinds can be pooled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from greyhound.core.arrays import FloatArray
from greyhound.traces.labels import Episode


@dataclass(frozen=True, slots=True)
class HindsightRules:
    window: int = 9
    slow: float = 1.12
    episode: float = 1.15
    borderline: float = 1.10
    near: float = 1.06
    min_len: int = 8
    merge: int = 30


def centred_median(x: FloatArray, window: int) -> FloatArray:
    """Median of the `window` points centred on each point (shorter at the ends)."""
    n = x.shape[0]
    half = window // 2
    padded = np.concatenate([np.full(half, np.nan), x, np.full(half, np.nan)])
    view = np.lib.stride_tricks.sliding_window_view(padded, window)[:n]
    out: FloatArray = np.nanmedian(view, axis=1)
    return out


def runs(mask: npt.NDArray[np.bool_]) -> list[tuple[int, int]]:
    """[start, end) of every run of True."""
    if not mask.any():
        return []
    d = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(d == 1).tolist(), np.flatnonzero(d == -1).tolist(),
                    strict=True))


def label_by_hindsight(times: FloatArray, t0: float, *, warmup: int = 0,
                       rules: HindsightRules | None = None
                       ) -> tuple[list[Episode], list[tuple[int, int]]]:
    """Episodes and ignored stretches of a whole trace whose healthy iteration time is t0."""
    r = rules or HindsightRules()
    x = np.asarray(times, dtype=np.float64) / t0
    smooth = centred_median(x, r.window)
    merged: list[list[int]] = []
    for a, b in runs(smooth > r.slow):
        if merged and a - merged[-1][1] < r.merge:
            merged[-1][1] = b
        else:
            merged.append([a, b])
    episodes: list[Episode] = []
    ignore: list[tuple[int, int]] = [(0, warmup)] if warmup > 0 else []
    for a, b in merged:
        if b - a < r.min_len:
            if b - a >= 3:
                ignore.append((a, b))
            continue
        level = float(np.median(x[a:b]))
        if level >= r.episode and a >= warmup:
            episodes.append(Episode(a, b, round(level, 3), a))
        elif level >= r.borderline or a < warmup:
            ignore.append((a, b))
    inside = np.zeros(x.shape[0], dtype=bool)
    for e in episodes:
        inside[e.start:e.end] = True
    ignore += [(a, b) for a, b in runs((x > r.slow) & ~inside) if 3 <= b - a < r.min_len]
    ignore += [(a, b) for a, b in runs((smooth > r.near) & (smooth <= r.slow) & ~inside)
               if b - a >= 3]
    return episodes, sorted(ignore)
