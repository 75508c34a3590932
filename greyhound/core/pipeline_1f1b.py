"""The exact 1F1B makespan of pipelines whose stages run at different speeds.

S3 consolidation has to know what a straggler costs in each stage, and no closed form says:
with uniform stages and m micro-batches a healthy pipeline takes (PP - 1 + m) t, but one slow
stage costs more the later it sits (PP3, m = 4, t = 1 s, one stage at 1.5 s: 7.0 s first,
7.5 s middle, 8.0 s last; Megatron's warm-up makes the first stage's extra time overlap most),
while the first and last stages of a real model also carry the embedding and the loss. So the
planner evaluates candidate layouts on the schedule itself: Megatron's 1F1B order per stage
(warm-up forwards, steady one-forward-one-backward, cool-down backwards), a forward waiting for
the previous stage's forward of the same micro-batch and a backward for the next stage's backward,
transfers free. Many candidate pipelines are evaluated at once (the batch dimension).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import numpy.typing as npt

from greyhound.core.arrays import FloatArray, IntArray


@dataclass(frozen=True, slots=True, eq=False)
class _Graph:
    stage: IntArray
    forward: npt.NDArray[np.bool_]
    prev: IntArray  # the stage's previous operation, or the sentinel n
    dep: IntArray  # the neighbouring stage's operation it waits for, or the sentinel n
    levels: tuple[IntArray, ...]  # operations with no dependency among them, in topological order


def _stage_ops(pp: int, m: int, s: int) -> list[tuple[bool, int]]:
    warm = min(pp - 1 - s, m)
    ops = [(True, i) for i in range(warm)]
    for i in range(m - warm):
        ops += [(True, warm + i), (False, i)]
    return ops + [(False, i) for i in range(m - warm, m)]


@lru_cache(maxsize=128)
def _graph(pp: int, m: int) -> _Graph:
    n = 2 * pp * m
    stage = np.repeat(np.arange(pp, dtype=np.int64), 2 * m)
    forward = np.zeros(n, dtype=bool)
    where: dict[tuple[int, bool, int], int] = {}
    for s in range(pp):
        for k, (fwd, i) in enumerate(_stage_ops(pp, m, s)):
            forward[s * 2 * m + k] = fwd
            where[(s, fwd, i)] = s * 2 * m + k
    prev = np.full(n, n, dtype=np.int64)
    dep = np.full(n, n, dtype=np.int64)
    for (s, fwd, i), o in where.items():
        if o % (2 * m):
            prev[o] = o - 1
        if fwd and s > 0:
            dep[o] = where[(s - 1, True, i)]
        elif not fwd and s < pp - 1:
            dep[o] = where[(s + 1, False, i)]
    done = np.zeros(n + 1, dtype=bool)
    done[n] = True
    levels: list[IntArray] = []
    while len(levels) == 0 or not done.all():
        ready = np.flatnonzero(~done[:n] & done[prev] & done[dep])
        levels.append(ready)
        done[ready] = True
    return _Graph(stage, forward, prev, dep, tuple(levels))


def pipeline_makespan(forward_s: FloatArray, backward_s: FloatArray, microbatches: int) -> FloatArray:
    """Seconds from the first forward to the last backward of each pipeline.

    ``forward_s`` and ``backward_s`` have shape (B, PP): one micro-batch's forward (backward) time
    on each stage of each of B pipelines. Returns shape (B,).
    """
    f = np.atleast_2d(np.asarray(forward_s, dtype=np.float64))
    b = np.atleast_2d(np.asarray(backward_s, dtype=np.float64))
    if f.shape != b.shape:
        raise ValueError(f"forward {f.shape} and backward {b.shape} times differ in shape")
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    g = _graph(f.shape[1], int(microbatches))
    dur = np.where(g.forward[:, None], f.T[g.stage], b.T[g.stage])
    end = np.zeros((len(g.stage) + 1, f.shape[0]))
    for ops in g.levels:
        end[ops] = np.maximum(end[g.prev[ops]], end[g.dep[ops]]) + dur[ops]
    return np.asarray(end.max(axis=0))
