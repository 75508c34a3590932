"""1F1B pipeline timing and NCCL collective cost models, vectorised over DP groups.

The pipeline is solved as a dependency graph rather than by formula, so that iteration time
*emerges* from per-stage, per-micro-batch durations (faults, jitter, uneven micro-batch counts).
The graph's shape depends only on (PP, m), so its topological order is computed once and cached;
each iteration then costs a few numpy operations per batch of independent operations, with the
DP groups as the vector dimension.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import numpy.typing as npt

from greyhound.core.arrays import FloatArray, IntArray


@dataclass(frozen=True, slots=True, eq=False)
class PipelineOrder:
    """The 1F1B graph of one DP group with ``m`` micro-batches on ``pp`` stages.

    Operation ``o = stage * 2m + k`` is the k-th operation stage ``stage`` runs. ``prev[o]`` is
    the operation before it on the same stage, ``dep[o]`` the operation on the neighbouring
    stage whose output it receives, ``xrow[o]`` the row of the transfer table that carries it;
    the sentinel ``n_ops`` means none. ``batches`` partitions the operations into groups with no
    dependency inside a group, listed in a valid topological order.
    """

    pp: int
    m: int
    stage: IntArray
    micro: IntArray
    forward: npt.NDArray[np.bool_]
    prev: IntArray
    dep: IntArray
    xrow: IntArray
    batches: tuple[IntArray, ...]

    @property
    def n_ops(self) -> int:
        return self.pp * 2 * self.m

    @property
    def n_xrows(self) -> int:
        """Transfer rows: forward s->s+1, then backward s+1->s, then the zero sentinel."""
        return 2 * (self.pp - 1) + 1


def stage_ops(pp: int, m: int, stage: int) -> list[tuple[bool, int]]:
    """Megatron's 1F1B order for one stage: warm-up forwards, steady 1F1B pairs, cool-down."""
    warm = min(pp - 1 - stage, m)
    ops = [(True, i) for i in range(warm)]
    for i in range(m - warm):
        ops += [(True, warm + i), (False, i)]
    ops += [(False, i) for i in range(m - warm, m)]
    return ops


@lru_cache(maxsize=256)
def pipeline_order(pp: int, m: int) -> PipelineOrder:
    n = pp * 2 * m
    stage = np.repeat(np.arange(pp), 2 * m)
    micro = np.empty(n, dtype=np.int64)
    forward = np.empty(n, dtype=bool)
    where: dict[tuple[int, bool, int], int] = {}
    for s in range(pp):
        for k, (fwd, i) in enumerate(stage_ops(pp, m, s)):
            o = s * 2 * m + k
            micro[o], forward[o] = i, fwd
            where[(s, fwd, i)] = o
    prev = np.full(n, n, dtype=np.int64)
    dep = np.full(n, n, dtype=np.int64)
    xrow = np.full(n, 2 * (pp - 1), dtype=np.int64)
    for o in range(n):
        s, i, fwd = int(stage[o]), int(micro[o]), bool(forward[o])
        if o % (2 * m):
            prev[o] = o - 1
        if fwd and s > 0:
            dep[o], xrow[o] = where[(s - 1, True, i)], s - 1
        elif not fwd and s < pp - 1:
            dep[o], xrow[o] = where[(s + 1, False, i)], pp - 1 + s
    # Uniform durations (forward 1, backward 2, free transfers) give every dependency a strictly
    # later start, so sorting by that start is a topological order and equal starts are independent.
    dur = np.where(forward, 1.0, 2.0)[:, None]
    start, _ = _solve(prev, dep, xrow, _ordered(prev, dep), dur, np.zeros((2 * pp - 1, 1)))
    keys = start[:n, 0]
    uniq, inverse = np.unique(keys, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    bounds = np.searchsorted(inverse[order], np.arange(len(uniq) + 1))
    batches = tuple(order[bounds[j] : bounds[j + 1]] for j in range(len(uniq)))
    return PipelineOrder(pp, m, stage, micro, forward, prev, dep, xrow, batches)


def _ordered(prev: IntArray, dep: IntArray) -> tuple[IntArray, ...]:
    """A one-operation-per-batch topological order (Kahn), only used to build the cache."""
    n = len(prev)
    done = np.zeros(n + 1, dtype=bool)
    done[n] = True
    out: list[IntArray] = []
    while len(out) < n:
        ready = np.flatnonzero(~done[:n] & done[prev] & done[dep])
        out.extend(np.array([o]) for o in ready)
        done[ready] = True
    return tuple(out)


def _solve(
    prev: IntArray,
    dep: IntArray,
    xrow: IntArray,
    batches: tuple[IntArray, ...],
    dur: FloatArray,
    xfer: FloatArray,
    floor: FloatArray | None = None,
) -> tuple[FloatArray, FloatArray]:
    n, d = dur.shape
    start = np.zeros((n + 1, d))
    end = np.zeros((n + 1, d))
    for b in batches:
        s = np.maximum(end[prev[b]], end[dep[b]]) + xfer[xrow[b]]
        start[b] = s
        end[b] = s + dur[b] if floor is None else np.maximum(s + dur[b], floor[b])
    return start, end


def run_pipeline(
    order: PipelineOrder, dur: FloatArray, xfer: FloatArray, floor: FloatArray | None = None
) -> tuple[FloatArray, FloatArray]:
    """Start and end of every operation, relative to the iteration start, for D groups at once.

    ``dur`` has shape (n_ops, D); ``xfer`` (n_xrows, D) with a zero last row. A receiving
    operation starts when both its own stage is free (the receive is posted) and the sender is
    done, plus the transfer time (NCCL's rendezvous for large messages). ``floor`` (n_ops, D),
    if given, is the earliest end of each operation whatever its start (its host has not
    issued it before). Returned arrays have an extra last row of zeros (the sentinel).
    """
    return _solve(order.prev, order.dep, order.xrow, order.batches, dur, xfer, floor)


def ring_allreduce_s(
    n: int, nbytes: float, bandwidth_Bps: FloatArray | float, latency_s: float
) -> FloatArray:
    """Ring all-reduce: reduce-scatter plus all-gather, 2(n-1) steps of bytes/n each."""
    if n <= 1:
        return np.zeros_like(np.asarray(bandwidth_Bps, dtype=np.float64))
    bw = np.asarray(bandwidth_Bps, dtype=np.float64)
    return 2.0 * (n - 1) / n * nbytes / bw + 2.0 * (n - 1) * latency_s


def tree_allreduce_s(
    n: int, nbytes: float, bandwidth_Bps: FloatArray | float, latency_s: float, efficiency: float
) -> FloatArray:
    """Double binary tree: logarithmic latency, slightly worse bandwidth than the ring."""
    if n <= 1:
        return np.zeros_like(np.asarray(bandwidth_Bps, dtype=np.float64))
    bw = np.asarray(bandwidth_Bps, dtype=np.float64)
    steps = 2.0 * math.ceil(math.log2(n))
    return 2.0 * (n - 1) / n * nbytes / (bw * efficiency) + steps * latency_s
