"""From a validated incident to one strategy's plan: between what the validator named (ranks,
rank pairs, benchmark times) and the pure planning cores, over the layout the job declared. No
I/O: the planner hands it the layout, the culprit and its costs as dataclasses.

* S2 (greyhound.core.microbatch): each DP group's time per micro-batch is 1 for a healthy group
  and, for a group holding a slow GPU, that GPU's measured slowdown: its GEMM time over the
  median of the GPUs it was compared with when the validation timed them, else the job's
  iteration slowdown (a lower bound: the iteration also holds communication).
* S3 (greyhound.core.role_swap, consolidate): a slow link is handed from DP to PP traffic by a
  node role swap; slow GPUs without a slow link are gathered into as few pipeline stages as
  possible.
* S4 (greyhound.core.restart): what a checkpoint-restart should replace and what it costs; only
  ever a recommendation.

Ranks become GPUs through the layout the job runs now (an earlier S3 plan moves ranks), GPUs
become nodes through the job's ``gpus_per_node``: host names play no part.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any

import numpy as np

from greyhound.core.consolidate import plan_consolidation
from greyhound.core.escalation import Strategy
from greyhound.core.layout import ParallelShape, swaps_between
from greyhound.core.microbatch import allocate_microbatches
from greyhound.core.plans import even_split
from greyhound.core.restart import Culprit as RestartCulprit
from greyhound.core.restart import RestartCosts, recommend_restart
from greyhound.core.role_swap import Traffic, plan_role_swap

NAMES = {Strategy.MICROBATCH: "S2", Strategy.TOPOLOGY: "S3", Strategy.RESTART: "S4"}
STRATEGIES = {v: k for k, v in NAMES.items()}


@dataclass(frozen=True, slots=True)
class Layout:
    """A job's parallel layout as it declares it (checked where it is declared: the REST
    model): Megatron's rank order ``rank = tp + TP * (dp + DP * pp)``, rank ``r`` starting on
    GPU ``r``, ``gpus_per_node`` GPUs a node, ``microbatches`` per iteration in DP shares that
    are multiples of ``multiple_of``; the traffic and checkpoint sizes when it gave them."""

    tp: int
    dp: int
    pp: int
    gpus_per_node: int
    microbatches: int
    multiple_of: int = 1
    dp_allreduce_bytes: float | None = None
    pp_activation_bytes: float | None = None
    checkpoint_bytes: float | None = None

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp


@dataclass(frozen=True, slots=True)
class PlanCosts:
    """What the plans weigh that a job may not have declared (its gradient and activation
    bytes), the consolidation solver's time limit, and what a checkpoint-restart costs (S4's
    price without a declared checkpoint size, else its write and read rates and fixed cost)."""

    gradient_bytes: float
    activation_bytes: float
    consolidate_time_limit_s: float
    restart_write_bytes_per_s: float
    restart_read_bytes_per_s: float
    restart_overhead_s: float
    s4_overhead_s: float


@dataclass(frozen=True, slots=True)
class JobState:
    """What the job runs now, as its newest delivery says; None is the job's own default."""

    microbatches: tuple[int, ...] | None = None
    gpu_of_rank: tuple[int, ...] | None = None

    def counts(self, layout: Layout) -> tuple[int, ...]:
        if self.microbatches is not None:
            return self.microbatches
        return even_split(layout.microbatches, layout.dp, layout.multiple_of)

    def gpus(self, layout: Layout) -> np.ndarray:
        if self.gpu_of_rank is not None:
            return np.asarray(self.gpu_of_rank, dtype=np.int64)
        return np.arange(layout.world, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class Culprit:
    """The validated culprit in ranks: slow GPUs (rank -> slowdown of its work) and slow links
    (rank pairs) with the slowdown they cause."""

    gpu_ranks: dict[int, float] = field(default_factory=dict)
    link_ranks: tuple[tuple[int, int], ...] = ()
    slowdown: float = 1.0

    @classmethod
    def from_validation(cls, *, gpu_ranks: Sequence[int], link_ranks: Sequence[tuple[int, int]],
                        gemm_s: Mapping[str, float], slowdown: float) -> Culprit:
        """From what the validator confirmed: the slow GPUs' ranks, the slow links' end ranks,
        and each GPU's GEMM time (by rank): a slow GPU's slowdown is its time over the median
        of the GPUs it was compared with, else the job's iteration ``slowdown``."""
        ranks = list(gpu_ranks)
        gemm = _gemm_times(gemm_s)
        peers = [t for r, t in gemm.items() if r not in ranks]
        base = median(peers) if peers else None
        slow = max(1.0, float(slowdown)) if math.isfinite(slowdown) else 1.0
        factors = {r: (gemm[r] / base if base and r in gemm and gemm[r] > base else slow)
                   for r in ranks}
        return cls(factors, tuple((int(a), int(b)) for a, b in link_ranks), slow)

    @property
    def empty(self) -> bool:
        return not self.gpu_ranks and not self.link_ranks


def _gemm_times(raw: Mapping[str, float]) -> dict[int, float]:
    out: dict[int, float] = {}
    for k, v in raw.items():
        try:
            rank, t = int(k), float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(t) and t > 0:
            out[rank] = t
    return out


@dataclass(frozen=True, slots=True)
class Proposal:
    """One strategy's plan: what it sets in the job's state (``microbatches`` or
    ``gpu_of_rank``), the GPU swaps that get there from the current layout, the parameters
    recorded with the plan, and its expected speed-up (iteration time before / after)."""

    strategy: str
    params: dict[str, Any]
    expected_gain: float | None
    summary: str
    microbatches: tuple[int, ...] | None = None
    gpu_of_rank: tuple[int, ...] | None = None
    swaps: tuple[tuple[int, int], ...] = ()


def available(layout: Layout, culprit: Culprit) -> set[Strategy]:
    """Strategies that have something to work with for this job and culprit."""
    out = {Strategy.RESTART}
    if culprit.gpu_ranks and layout.dp > 1:
        out.add(Strategy.MICROBATCH)
    if (culprit.link_ranks and layout.world > layout.gpus_per_node) or \
            (culprit.gpu_ranks and layout.pp > 1):
        out.add(Strategy.TOPOLOGY)
    return out


def propose(strategy: Strategy, layout: Layout, culprit: Culprit, state: JobState,
            costs: PlanCosts) -> Proposal | None:
    """The plan for ``strategy``, or None when it would change nothing."""
    if strategy is Strategy.MICROBATCH:
        return microbatch_plan(layout, culprit, state)
    if strategy is Strategy.TOPOLOGY:
        if culprit.link_ranks:
            return role_swap_plan(layout, culprit, state, costs)
        return consolidation_plan(layout, culprit, state, costs)
    if strategy is Strategy.RESTART:
        return restart_plan(layout, culprit, state, costs)
    return None


def microbatch_plan(layout: Layout, culprit: Culprit, state: JobState) -> Proposal | None:
    times = np.ones(layout.dp)
    shape = _shape(layout)
    for rank, factor in culprit.gpu_ranks.items():
        if 0 <= rank < layout.world:
            d = int(shape.coords(rank)[1])
            times[d] = max(times[d], factor)
    if np.all(times <= 1.0):
        return None
    now = state.counts(layout)
    plan = allocate_microbatches(times, layout.microbatches, multiple_of=layout.multiple_of)
    before = float(np.max(np.asarray(now) * times))
    if plan.counts == now or plan.makespan >= before:
        return None
    slow = sorted(int(d) for d in np.flatnonzero(times > 1.0))
    gain = before / plan.makespan
    return Proposal(
        "S2", {"kind": "microbatch", "microbatches": list(plan.counts), "previous": list(now),
               "times": [round(float(t), 4) for t in times], "multiple_of": layout.multiple_of,
               "slow_dp_groups": slow, "makespan_before": before, "makespan_after": plan.makespan},
        gain, f"micro-batches per DP group {list(now)} -> {list(plan.counts)} (slow DP group(s) "
        f"{slow}; {gain:.2f}x on the slowest group)", microbatches=plan.counts)


def role_swap_plan(layout: Layout, culprit: Culprit, state: JobState,
                   costs: PlanCosts) -> Proposal | None:
    gpus = state.gpus(layout)
    gpn = layout.gpus_per_node
    factor = max(culprit.slowdown, 1.01)
    congested: dict[tuple[int, int], float] = {}
    for a, b in culprit.link_ranks:
        if not (0 <= a < layout.world and 0 <= b < layout.world):
            continue
        na, nb = int(gpus[a]) // gpn, int(gpus[b]) // gpn
        if na != nb:
            congested[(min(na, nb), max(na, nb))] = factor
    if not congested:
        return None
    traffic = Traffic(layout.dp_allreduce_bytes or costs.gradient_bytes,
                      layout.pp_activation_bytes or costs.activation_bytes,
                      max(1, layout.microbatches // layout.dp))
    plan = plan_role_swap(_shape(layout), gpn, congested, traffic, gpu_of_rank=gpus)
    if not plan.swaps:
        return None
    ratio = plan.score_after / plan.score_before if plan.score_before > 0 else 1.0
    gain = culprit.slowdown / (1.0 + (culprit.slowdown - 1.0) * ratio)
    links = sorted(congested)
    return Proposal(
        "S3", {"kind": "role_swap", "links": [list(x) for x in links],
               "node_pairs": [list(p) for p in plan.node_pairs],
               "swaps": [list(p) for p in plan.swaps], "gpu_of_rank": list(plan.gpu_of_rank),
               "score_before": plan.score_before, "score_after": plan.score_after},
        gain, f"swap the roles of nodes {', '.join(f'{a}<->{b}' for a, b in plan.node_pairs)} "
        f"so that slow link(s) {', '.join(f'{a}-{b}' for a, b in links)} carry pipeline "
        f"instead of data-parallel traffic", gpu_of_rank=plan.gpu_of_rank, swaps=plan.swaps)


def consolidation_plan(layout: Layout, culprit: Culprit, state: JobState,
                       costs: PlanCosts) -> Proposal | None:
    gpus = state.gpus(layout)
    stragglers = {int(gpus[r]): f for r, f in culprit.gpu_ranks.items()
                  if 0 <= r < layout.world}
    if not stragglers or layout.pp < 2:
        return None
    plan = plan_consolidation(_shape(layout), stragglers, microbatches=list(state.counts(layout)),
                              gpu_of_rank=gpus, time_limit_s=costs.consolidate_time_limit_s)
    if not plan.swaps or plan.after_s >= plan.before_s:
        return None
    gain = plan.before_s / plan.after_s
    return Proposal(
        "S3", {"kind": "consolidate", "stragglers": {str(g): f for g, f in stragglers.items()},
               "cells": [list(c) for c in plan.cells], "swaps": [list(p) for p in plan.swaps],
               "gpu_of_rank": list(plan.gpu_of_rank), "before_s": plan.before_s,
               "after_s": plan.after_s, "method": plan.method},
        gain, f"gather slow GPU(s) {sorted(stragglers)} into pipeline cell(s) "
        f"{[list(c) for c in plan.cells]} ({gain:.2f}x on the 1F1B makespan)",
        gpu_of_rank=plan.gpu_of_rank, swaps=plan.swaps)


def restart_plan(layout: Layout, culprit: Culprit, state: JobState,
                 costs: PlanCosts) -> Proposal | None:
    gpus = state.gpus(layout)
    gpn = layout.gpus_per_node
    bad_gpus = tuple(sorted({int(gpus[r]) for r in culprit.gpu_ranks if 0 <= r < layout.world}))
    links = {(min(na, nb), max(na, nb)) for a, b in culprit.link_ranks
             if 0 <= a < layout.world and 0 <= b < layout.world
             and (na := int(gpus[a]) // gpn) != (nb := int(gpus[b]) // gpn)}
    if not bad_gpus and not links:
        return None
    priced = RestartCosts(layout.checkpoint_bytes or 0.0, costs.restart_write_bytes_per_s,
                          costs.restart_read_bytes_per_s, costs.restart_overhead_s)
    rec = recommend_restart(RestartCulprit(bad_gpus, tuple(sorted(links))), priced,
                            gpus_per_node=gpn)
    cost = rec.cost_s if layout.checkpoint_bytes else costs.s4_overhead_s
    return Proposal(
        "S4", {"kind": "restart", "replace_gpus": list(rec.replace_gpus),
               "replace_nodes": list(rec.replace_nodes), "fallback_nodes": list(rec.fallback_nodes),
               "links": [list(x) for x in rec.links], "cost_s": cost,
               "priced": bool(layout.checkpoint_bytes), "summary": rec.summary},
        None, rec.summary if layout.checkpoint_bytes else
        f"{rec.summary.split(':')[0]}: cost not priced (no checkpoint size declared; "
        f"estimated {cost:.0f} s)")


def restart_overhead(layout: Layout, costs: PlanCosts) -> float:
    """S4's overhead: the price recommend_restart puts on a restart that saves a checkpoint first
    (write, read, fixed overhead) when the job declared its checkpoint size, else the setting."""
    size = layout.checkpoint_bytes
    if not size:
        return costs.s4_overhead_s
    return (size / costs.restart_write_bytes_per_s + size / costs.restart_read_bytes_per_s
            + costs.restart_overhead_s)


def next_state(state: JobState, layout: Layout, *, microbatches: tuple[int, ...] | None,
               gpu_of_rank: tuple[int, ...] | None) -> tuple[JobState, tuple[tuple[int, int], ...]]:
    """The state after setting ``microbatches`` and/or ``gpu_of_rank`` (None: leave as is), and
    the GPU swaps from the current layout to the new one. A state equal to the job's default
    is written as None, so that reverting everything reads as "your own layout"."""
    counts = state.microbatches if microbatches is None else microbatches
    if counts is not None and counts == even_split(layout.microbatches, layout.dp,
                                                   layout.multiple_of):
        counts = None
    before = state.gpus(layout)
    target = before if gpu_of_rank is None else np.asarray(gpu_of_rank, dtype=np.int64)
    swaps = swaps_between(before, target)
    identity = bool(np.array_equal(target, np.arange(layout.world)))
    return JobState(counts, None if identity else tuple(int(g) for g in target)), swaps


def undo_swaps(state: JobState, layout: Layout,
               swaps: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """The rank -> GPU map after exchanging ``swaps`` back, last first (undoes a topology plan
    applied on top of the current layout)."""
    gpus = state.gpus(layout).copy()
    rank_of = np.empty_like(gpus)
    rank_of[gpus] = np.arange(len(gpus))
    for a, b in reversed(swaps):
        rank_of[[a, b]] = rank_of[[b, a]]
    out = np.empty_like(gpus)
    out[rank_of] = np.arange(len(gpus))
    return tuple(int(g) for g in out)


def _shape(layout: Layout) -> ParallelShape:
    return ParallelShape(layout.tp, layout.dp, layout.pp)
