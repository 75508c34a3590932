"""Training throughput of a run: iterations per minute over the whole run and over time.

A run is its iterations as (virtual start, duration) pairs: the offline model's for the healthy
job and for the job left to its faults, the live simulation's (pauses included) for the job that
followed Greyhound's plans. An iteration counts for the window in which it ended.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from greyhound.core.arrays import FloatArray
from greyhound.sim.offline import run_offline
from greyhound.sim.scenario import Scenario

Iterations = Sequence[tuple[float, float]]


def offline_iterations(sc: Scenario, *, faults: bool = True) -> list[tuple[float, float]]:
    """The scenario's iterations with no plan followed; ``faults=False``: the healthy job (same
    seed, so the same jitter draws)."""
    if not faults:
        sc = dataclasses.replace(sc, faults=())
    out: list[tuple[float, float]] = []
    t = 0.0
    for d in run_offline(sc):
        out.append((t, d))
        t += d
    return out


def ends(iterations: Iterations) -> FloatArray:
    return np.array([s + d for s, d in iterations], dtype=np.float64)


def per_minute(iterations: Iterations, duration_s: float) -> float:
    """Iterations completed within [0, duration_s), per minute."""
    if duration_s <= 0:
        raise ValueError("duration_s must be positive")
    return float(np.count_nonzero(ends(iterations) < duration_s)) * 60.0 / duration_s


def over_time(iterations: Iterations, duration_s: float,
              bin_s: float) -> tuple[FloatArray, FloatArray]:
    """(window centres, iterations per minute in each window of ``bin_s``)."""
    if bin_s <= 0:
        raise ValueError("bin_s must be positive")
    edges = np.arange(0.0, duration_s + 1e-9, bin_s)
    if edges[-1] < duration_s:
        edges = np.append(edges, duration_s)
    counts, _ = np.histogram(ends(iterations), bins=edges)
    width = np.diff(edges)
    return (edges[:-1] + width / 2), counts * 60.0 / width
