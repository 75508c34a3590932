"""S3 (b): gather compute stragglers into as few pipeline stages as possible (GREYHOUND Fig. 12).

Inside one pipeline, every micro-batch passes every stage, and a stage runs at its slowest member
(its TP ranks synchronise on every layer), so two stragglers in two stages cost two slow stages
while two stragglers in one stage cost one. k stragglers need ceil(k / (TP x DP)) stages: a stage
holds TP GPUs in each of the DP pipelines, and filling a stage across pipelines first leaves every
pipeline with the fewest slow stages (the iteration waits for the slowest pipeline).

Which stages: the ones whose makespan is smallest, measured on the exact 1F1B schedule
(:mod:`greyhound.core.pipeline_1f1b`) with the per-stage times the caller gives (the first and
last stages of a real model carry embedding and loss work, which is why the paper prefers inner
stages; with uniform stages the schedule itself favours the first).

Closed form: when every straggler is equally slow and every pipeline runs the same number of
micro-batches, the pipelines are interchangeable and the best layout fills the best n-stage set
(any pipeline holding more slow stages is no faster than one holding a subset of them); the sets
are enumerated and each is timed exactly (they are enumerated in the other cases too, as
candidates). Otherwise (stragglers of different severity, pipelines
with different micro-batch counts after S2, or too many sets) the assignment is a mixed-integer
program (:mod:`greyhound.core.consolidate_milp`) over a linear estimate of 1F1B time, solved with
a time limit; its best layout so far is then timed exactly like the others. Every candidate is
compared with leaving the layout alone, and ties go to fewer moved stragglers.

Transfers and the links the moved ranks then use are not modelled here; the simulator checks plans
with them (tests/core/test_consolidate_sim.py).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from greyhound.core.arrays import FloatArray, IntArray
from greyhound.core.layout import ParallelShape, checked_layout, swaps_between
from greyhound.core.pipeline_1f1b import pipeline_makespan

Method = Literal["unchanged", "enumerated", "milp", "milp-capped"]


@dataclass(frozen=True, slots=True)
class ConsolidationPlan:
    """``swaps``: GPU pairs that exchange ranks, in order. ``cells``: the (stage, DP group) cells
    holding stragglers afterwards. Times are the slowest pipeline's 1F1B compute makespan."""

    swaps: tuple[tuple[int, int], ...]
    cells: tuple[tuple[int, int], ...]
    gpu_of_rank: tuple[int, ...]
    before_s: float
    after_s: float
    method: Method


@dataclass(frozen=True, slots=True)
class PipelineCosts:
    """What the timing of one layout needs: per-stage healthy times and micro-batches per pipeline."""

    forward_s: FloatArray  # (PP,)
    backward_s: FloatArray  # (PP,)
    microbatches: IntArray  # (DP,)

    def makespan(self, slow: FloatArray) -> FloatArray:
        """Slowest pipeline's makespan for each candidate; ``slow`` is (C, PP, DP) stage factors."""
        out = np.zeros(slow.shape[0])
        for m in np.unique(self.microbatches):
            ds = np.flatnonzero(self.microbatches == m)
            f = slow[:, :, ds].transpose(0, 2, 1).reshape(-1, slow.shape[1])
            t = pipeline_makespan(f * self.forward_s, f * self.backward_s, int(m))
            out = np.maximum(out, t.reshape(slow.shape[0], len(ds)).max(axis=1))
        return out


def plan_consolidation(
    shape: ParallelShape,
    stragglers: Mapping[int, float],
    *,
    microbatches: int | Sequence[int],
    stage_forward_s: Sequence[float] | None = None,
    stage_backward_s: Sequence[float] | None = None,
    gpu_of_rank: Sequence[int] | IntArray | None = None,
    time_limit_s: float = 10.0,
    max_enumerated: int = 4096,
) -> ConsolidationPlan:
    """Move straggler GPUs (GPU id -> slow factor, >= 1) into the stages that cost least."""
    layout = checked_layout(shape, gpu_of_rank)
    costs = _costs(shape, microbatches, stage_forward_s, stage_backward_s)
    gpus, factors = _stragglers(shape, stragglers)
    rank_of_gpu = np.empty_like(layout)
    rank_of_gpu[layout] = np.arange(shape.world)
    stage, dp, _ = shape.coords(rank_of_gpu[gpus])
    current = stage * shape.dp + dp  # each straggler's cell, as stage * DP + dp
    candidates: list[tuple[IntArray, Method]] = [(current, "unchanged")]
    equal = len(gpus) > 0 and bool(np.all(factors == factors[0]))
    n_stages = math.ceil(len(gpus) / (shape.tp * shape.dp)) if len(gpus) else 0
    enumerable = len(gpus) > 0 and math.comb(shape.pp, n_stages) <= max_enumerated
    if enumerable:
        candidates += [(c, "enumerated") for c in _enumerated(shape, costs, factors, current, n_stages)]
    closed_form = enumerable and equal and len(set(costs.microbatches.tolist())) == 1
    if len(gpus) and not closed_form:
        from greyhound.core.consolidate_milp import assign_cells

        found = assign_cells(shape, costs, factors, current, time_limit_s=time_limit_s)
        if found is not None:
            candidates.append((found.cells, "milp-capped" if found.capped else "milp"))
    cells = np.stack([c for c, _ in candidates]) if len(gpus) else np.zeros((1, 0), np.int64)
    slow = np.ones((len(candidates), shape.pp * shape.dp))
    for i in range(len(candidates)):
        np.maximum.at(slow[i], cells[i], factors)
    spans = costs.makespan(slow.reshape(-1, shape.pp, shape.dp))
    moves = (cells != current[None, :]).sum(axis=1)
    best = int(np.lexsort((np.arange(len(candidates)), moves, _rounded(spans)))[0])
    target = _place(shape, layout, rank_of_gpu, gpus, current, cells[best])
    chosen = sorted({(int(c) // shape.dp, int(c) % shape.dp) for c in cells[best]})
    return ConsolidationPlan(
        swaps=swaps_between(layout, target),
        cells=tuple(chosen),
        gpu_of_rank=tuple(int(g) for g in target),
        before_s=float(spans[0]),
        after_s=float(spans[best]),
        method=candidates[best][1] if moves[best] else "unchanged",
    )


def _rounded(spans: FloatArray) -> FloatArray:
    """Makespans equal up to float noise compare equal, so the fewer-moves rule decides."""
    return np.asarray(np.round(spans / (np.max(spans) or 1.0), 12))


def _costs(
    shape: ParallelShape,
    microbatches: int | Sequence[int],
    forward: Sequence[float] | None,
    backward: Sequence[float] | None,
) -> PipelineCosts:
    m = np.broadcast_to(np.asarray(microbatches, dtype=np.int64), (shape.dp,)).copy()
    if np.any(m < 1):
        raise ValueError("microbatches: every pipeline needs at least one micro-batch")
    f = np.full(shape.pp, 1.0 / 3.0) if forward is None else np.asarray(forward, dtype=np.float64)
    b = np.full(shape.pp, 2.0 / 3.0) if backward is None else np.asarray(backward, dtype=np.float64)
    for name, x in (("stage_forward_s", f), ("stage_backward_s", b)):
        if x.shape != (shape.pp,) or not np.all(np.isfinite(x)) or np.any(x <= 0):
            raise ValueError(f"{name}: {shape.pp} positive finite values expected, got {x.tolist()}")
    return PipelineCosts(f, b, m)


def _stragglers(shape: ParallelShape, stragglers: Mapping[int, float]) -> tuple[IntArray, FloatArray]:
    """Sorted by severity (slowest first), then GPU id, so plans do not depend on dict order."""
    items = sorted(stragglers.items(), key=lambda kv: (-float(kv[1]), int(kv[0])))
    for gpu, factor in items:
        if not 0 <= int(gpu) < shape.world:
            raise ValueError(f"stragglers: GPU {gpu} out of range [0, {shape.world})")
        if not (math.isfinite(factor) and factor >= 1.0):
            raise ValueError(f"stragglers: GPU {gpu} factor {factor!r} must be finite and >= 1")
    gpus = np.array([int(g) for g, _ in items], dtype=np.int64)
    return gpus, np.array([float(f) for _, f in items], dtype=np.float64)


def _enumerated(
    shape: ParallelShape, costs: PipelineCosts, factors: FloatArray, current: IntArray, n: int
) -> list[IntArray]:
    """One candidate per n-stage set: its cells filled stage-major, pipeline by pipeline, the most
    severe stragglers first (optimal when all are equally slow; a good start otherwise)."""
    single = np.ones((shape.pp, shape.pp, shape.dp))
    single[np.arange(shape.pp), np.arange(shape.pp), :] = factors[0]
    stage_rank = np.argsort(costs.makespan(single), kind="stable")
    order = np.empty(shape.pp, dtype=np.int64)
    order[stage_rank] = np.arange(shape.pp)
    out = []
    for chosen in itertools.combinations(range(shape.pp), n):
        stages = sorted(chosen, key=lambda s: order[s])
        slots = [s * shape.dp + d for s in stages for d in range(shape.dp) for _ in range(shape.tp)]
        out.append(_match(current, slots))
    return out


def _match(current: IntArray, slots: list[int]) -> IntArray:
    """Equally slow stragglers fill ``slots``; those already in a slot's cell stay there."""
    free = list(slots)
    cells = np.full(len(current), -1, dtype=np.int64)
    for i, c in enumerate(current):
        if int(c) in free:
            free.remove(int(c))
            cells[i] = c
    for j in np.flatnonzero(cells < 0):
        cells[j] = free.pop(0)
    return cells


def _place(
    shape: ParallelShape,
    layout: IntArray,
    rank_of_gpu: IntArray,
    gpus: IntArray,
    current: IntArray,
    cells: IntArray,
) -> IntArray:
    """The rank -> GPU map with each straggler in its cell: stragglers already there keep their
    rank, movers take the cell's ranks held by healthy GPUs, displaced GPUs take the freed ranks."""
    target = layout.copy()
    straggler = np.zeros(shape.world, dtype=bool)
    straggler[gpus] = True
    movers = np.flatnonzero(cells != current)
    if not len(movers):
        return target
    claimed: set[int] = set()
    wanted: list[int] = []
    staying = {int(rank_of_gpu[g]) for j, g in enumerate(gpus) if cells[j] == current[j]}
    for i in movers:
        stage, dp = divmod(int(cells[i]), shape.dp)
        ranks = [shape.rank(stage, dp, t) for t in range(shape.tp)]
        # Prefer a rank a healthy GPU holds; a straggler that leaves this cell also frees its rank.
        free = [r for r in ranks if r not in claimed and r not in staying]
        free.sort(key=lambda r: bool(straggler[layout[r]]))
        claimed.add(free[0])
        wanted.append(free[0])
    mover_gpus = gpus[movers]
    vacated = sorted(set(int(rank_of_gpu[g]) for g in mover_gpus) - set(wanted))
    displaced = [int(layout[r]) for r in sorted(set(wanted)) if int(layout[r]) not in set(mover_gpus)]
    for g, r in zip(mover_gpus, wanted, strict=True):
        target[r] = g
    for g, r in zip(displaced, vacated, strict=True):
        target[r] = g
    return target
