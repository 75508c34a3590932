"""Mitigation plans as the simulated job receives them, and their effect on its layout.

GREYHOUND's strategies (PAPERS.md, mitigation): S2 sets per-DP-group micro-batch counts; S3
swaps which nodes carry DP and PP traffic, or moves ranks between PP stages to consolidate
stragglers; S4 restarts from a checkpoint, possibly on replaced parts. A plan changes the
layout; it never changes the faults themselves, except that a restart on new parts leaves the
old faulty parts behind.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from greyhound.sim.scenario import CostSpec, FaultSpec, JobSpec

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class MicrobatchPlan:
    """S2: micro-batches per DP group, applied from the next iteration; they must sum to M."""

    counts: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SwapNodesPlan:
    """S3: each pair of nodes exchanges roles (every GPU takes the other node's ranks)."""

    pairs: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class SwapGpusPlan:
    """S3: each pair of GPUs exchanges ranks, e.g. to gather stragglers into one PP stage."""

    pairs: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class RestartPlan:
    """S4: checkpoint and restart, replacing the listed GPUs and nodes with healthy ones."""

    replace_gpus: tuple[int, ...] = ()
    replace_nodes: tuple[int, ...] = ()


Plan = MicrobatchPlan | SwapNodesPlan | SwapGpusPlan | RestartPlan


class PlanError(ValueError):
    """A plan the job cannot apply (wrong sizes, unknown GPU or node)."""


def even_split(total: int, groups: int) -> tuple[int, ...]:
    """Megatron's default: M micro-batches split evenly, any remainder to the first groups."""
    base, extra = divmod(total, groups)
    return tuple(base + (1 if i < extra else 0) for i in range(groups))


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
