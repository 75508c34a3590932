"""How the simulated job applies a mitigation plan (greyhound.core.plans) to its layout.

A plan changes the layout; it never changes the faults themselves, except that a restart on new
parts leaves the old faulty parts behind. The layout stays here: besides the counts and the GPU
of each rank it holds which of the scenario's faults a restart cleared, a simulator notion.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from greyhound.core.arrays import IntArray
from greyhound.core.plans import (
    MicrobatchPlan,
    Plan,
    PlanError,
    RestartPlan,
    SwapGpusPlan,
    SwapNodesPlan,
    even_split,
)
from greyhound.sim.scenario import CostSpec, FaultSpec, JobSpec


@dataclass(slots=True)
class Layout:
    """The mutable part of the job a plan changes."""

    counts: tuple[int, ...]
    gpu_of_rank: IntArray
    cleared: set[int] = field(default_factory=set)
    version: int = 0

    @classmethod
    def initial(cls, job: JobSpec) -> Layout:
        return cls(even_split(job.microbatches, job.dp), np.arange(job.world, dtype=np.int64))

    def rank_of_gpu(self) -> IntArray:
        inverse = np.empty_like(self.gpu_of_rank)
        inverse[self.gpu_of_rank] = np.arange(len(self.gpu_of_rank))
        return inverse


def apply(
    plan: Plan,
    layout: Layout,
    job: JobSpec,
    faults: Sequence[FaultSpec],
    costs: CostSpec,
    now: float,
) -> float:
    """Change ``layout`` in place at virtual time ``now``; return the action's cost in seconds."""
    if isinstance(plan, MicrobatchPlan):
        _check_counts(plan.counts, job)
        layout.counts = tuple(plan.counts)
        cost = costs.microbatch_s
    elif isinstance(plan, SwapNodesPlan | SwapGpusPlan):
        gpu_pairs = _gpu_pairs(plan, job)
        rank_of_gpu = layout.rank_of_gpu()
        for a, b in gpu_pairs:
            rank_of_gpu[[a, b]] = rank_of_gpu[[b, a]]
        layout.gpu_of_rank[rank_of_gpu] = np.arange(job.world)
        cost = costs.reconfigure_s if gpu_pairs else 0.0
    else:
        layout.cleared |= _cleared_by_restart(plan, job, faults, now)
        cost = costs.restart_s
    layout.version += 1
    return cost


def _check_counts(counts: Sequence[int], job: JobSpec) -> None:
    if len(counts) != job.dp:
        raise PlanError(f"counts: {len(counts)} entries for {job.dp} DP groups")
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
        raise PlanError("counts: every DP group needs a positive integer number of micro-batches")
    if sum(counts) != job.microbatches:
        raise PlanError(f"counts: sum {sum(counts)} != microbatches {job.microbatches}")


def _gpu_pairs(plan: SwapNodesPlan | SwapGpusPlan, job: JobSpec) -> list[tuple[int, int]]:
    if isinstance(plan, SwapGpusPlan):
        for pair in plan.pairs:
            if not all(0 <= g < job.world for g in pair):
                raise PlanError(f"pairs: GPU pair {pair} out of range [0, {job.world})")
        return [(int(a), int(b)) for a, b in plan.pairs if a != b]
    g = job.gpus_per_node
    out: list[tuple[int, int]] = []
    for a, b in plan.pairs:
        if not (0 <= a < job.nodes and 0 <= b < job.nodes):
            raise PlanError(f"pairs: node pair {(a, b)} out of range [0, {job.nodes})")
        if a != b:
            ga = range(a * g, min((a + 1) * g, job.world))
            gb = range(b * g, min((b + 1) * g, job.world))
            if len(ga) != len(gb):
                raise PlanError(f"pairs: nodes {a} and {b} hold different numbers of GPUs")
            out += list(zip(ga, gb, strict=True))
    return out


def _cleared_by_restart(
    plan: RestartPlan, job: JobSpec, faults: Sequence[FaultSpec], now: float
) -> set[int]:
    """Software hangs that struck go with the processes; hardware faults only with the part."""
    nodes = set(plan.replace_nodes)
    gpus = set(plan.replace_gpus) | {
        g for g in range(job.world) if g // job.gpus_per_node in nodes
    }
    out: set[int] = set()
    for i, f in enumerate(faults):
        gone = (
            (f.kind in ("hang_not_entered", "hang_inconsistent") and f.start_s <= now)
            or (f.kind in ("gpu_slow", "hang_hardware") and f.rank in gpus)
            or (f.kind == "cpu_contention" and f.node in nodes)
            or (f.kind == "link_congestion" and f.nodes is not None and bool(nodes & set(f.nodes)))
        )
        if gone:
            out.add(i)
    return out
