"""A job's iteration-time timeline, per-rank heat map and per-rank state (pure: batches in).

The heat map shows *lateness* where the job was profiled in the window: for each collective
instance (communicator, sequence) that every member reported, a rank's lateness is its arrival
(GPU start where timed, else host entry) minus the earliest member's, averaged per time bucket.
A straggler arrives late at every synchronisation, so its row lights up while its peers stay
dark. Without collectives (monitor mode) it falls back to *slowdown*, each rank's iteration
time over the job's healthy level (the 25th percentile of the bucket medians); in a synchronous
job every rank then slows together, so that view dates the problem but does not single out a rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

import numpy as np

from services.common.bus.contract import CollectiveBatch, IterationBatch

HeatBasis = Literal["lateness", "slowdown", "none"]


@dataclass(frozen=True)
class Timeline:
    start: datetime
    bucket_s: float
    times: list[float]
    median_s: list[float | None]
    max_s: list[float | None]
    ranks: list[int]
    heat: list[list[float | None]]
    heat_basis: HeatBasis
    heat_unit: str


@dataclass(frozen=True)
class RankState:
    rank: int
    last_iteration: int | None
    last_iteration_s: float | None
    last_end: datetime | None
    state: Literal["ok", "slow", "stale", "unknown"]


def _columns(batches: Sequence[IterationBatch]) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                         np.ndarray]:
    if not batches:
        empty = np.zeros(0)
        return empty.astype(np.int64), empty.astype(np.int64), empty.astype(np.int64), empty
    rank = np.concatenate([np.asarray(b.rank, dtype=np.int64) for b in batches])
    it = np.concatenate([np.asarray(b.iteration, dtype=np.int64) for b in batches])
    end = np.concatenate([np.asarray(b.end_ns, dtype=np.int64) for b in batches])
    dur = np.concatenate([np.asarray(b.duration_s, dtype=np.float64) for b in batches])
    return rank, it, end, dur


def _finite(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def _lateness(colls: Sequence[CollectiveBatch], t0_ns: int, bucket_ns: int, nb: int,
              ranks: list[int]) -> list[list[float | None]] | None:
    rows = [(r, c, s, n, (g if g > 0 else e))
            for b in colls
            for r, c, s, n, e, g, p in zip(b.rank, b.comm_id, b.seq, b.nranks, b.enter_ns,
                                           b.gpu_start_ns, b.peer, strict=True) if p < 0]
    if not rows:
        return None
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    size: dict[tuple[int, int], int] = {}
    for r, c, s, n, t in rows:
        groups.setdefault((c, s), []).append((r, t))
        size[(c, s)] = n
    index = {r: i for i, r in enumerate(ranks)}
    total = np.zeros((len(ranks), nb))
    count = np.zeros((len(ranks), nb))
    for key, members in groups.items():
        if len(members) < size[key]:
            continue  # an instance some member did not report says nothing about who was late
        first = min(t for _, t in members)
        b = min(max((first - t0_ns) // bucket_ns, 0), nb - 1)
        for r, t in members:
            i = index.get(r)
            if i is not None:
                total[i, b] += (t - first) / 1e6
                count[i, b] += 1
    if not count.any():
        return None
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = total / count
    return [[_finite(v) if count[i, j] else None for j, v in enumerate(row)]
            for i, row in enumerate(mean)]


def job_timeline(iters: Sequence[IterationBatch], colls: Sequence[CollectiveBatch], *,
                 since: datetime, until: datetime, buckets: int) -> Timeline:
    nb = max(1, buckets)
    t0 = int(since.timestamp() * 1e9)
    span = max(int(until.timestamp() * 1e9) - t0, 1)
    bucket_ns = max(span // nb, 1)
    rank, _, end, dur = _columns(iters)
    keep = end >= t0
    rank, end, dur = rank[keep], end[keep], dur[keep]
    bins = np.clip((end - t0) // bucket_ns, 0, nb - 1) if len(end) else np.zeros(0, dtype=np.int64)
    ranks = sorted({int(r) for r in rank} | {int(r) for b in colls for r in b.rank})
    med: list[float | None] = []
    mx: list[float | None] = []
    for j in range(nb):
        d = dur[bins == j]
        med.append(float(np.median(d)) if len(d) else None)
        mx.append(float(d.max()) if len(d) else None)
    heat = _lateness(colls, t0, bucket_ns, nb, ranks)
    basis: HeatBasis = "lateness"
    unit = "ms late at collectives"
    if heat is None:
        basis, unit = ("slowdown", "x healthy iteration time") if len(dur) else ("none", "")
        known = [m for m in med if m is not None]
        healthy = float(np.percentile(known, 25)) if known else 1.0
        index = {r: i for i, r in enumerate(ranks)}
        grid: list[list[float | None]] = [[None] * nb for _ in ranks]
        for r in np.unique(rank):
            sel = rank == r
            for j in np.unique(bins[sel]):
                v = float(np.median(dur[sel & (bins == j)])) / healthy if healthy > 0 else None
                grid[index[int(r)]][int(j)] = v
        heat = grid
    times = [(t0 + j * bucket_ns) / 1e9 for j in range(nb)]
    return Timeline(start=since, bucket_s=bucket_ns / 1e9, times=times, median_s=med, max_s=mx,
                    ranks=ranks, heat=heat, heat_basis=basis, heat_unit=unit)


def rank_states(iters: Sequence[IterationBatch], ranks: Sequence[int], *, now: datetime,
                slow_ratio: float = 1.1, stale_after_s: float = 30.0) -> list[RankState]:
    """Each rank's newest iteration and a word for it: slow (over ``slow_ratio`` x the job's
    median of newest iterations), stale (nothing for max(``stale_after_s``, 10 iterations)),
    unknown (nothing in the window), else ok."""
    rank, it, end, dur = _columns(iters)
    last: dict[int, tuple[int, int, float]] = {}
    for r, i, e, d in zip(rank.tolist(), it.tolist(), end.tolist(), dur.tolist(), strict=True):
        if r not in last or e > last[r][1]:
            last[r] = (i, e, d)
    typical = float(np.median([v[2] for v in last.values()])) if last else 0.0
    now_ns = now.timestamp() * 1e9
    out: list[RankState] = []
    for r in sorted(set(ranks) | set(last)):
        if r not in last:
            out.append(RankState(r, None, None, None, "unknown"))
            continue
        i, e, d = last[r]
        state: Literal["ok", "slow", "stale", "unknown"] = "ok"
        if (now_ns - e) / 1e9 > max(stale_after_s, 10 * typical):
            state = "stale"
        elif typical > 0 and d > slow_ratio * typical:
            state = "slow"
        out.append(RankState(r, i, d, datetime.fromtimestamp(e / 1e9, UTC), state))
    return out
