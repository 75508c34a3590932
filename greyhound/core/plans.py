"""The mitigation plans a planner makes, in the form a job (real or simulated) applies them.

GREYHOUND's strategies (PAPERS.md, mitigation): S2 sets per-DP-group micro-batch counts; S3
swaps which nodes carry DP and PP traffic, or moves ranks between PP stages to consolidate
stragglers; S4 restarts from a checkpoint, possibly on replaced parts. The planner's cores
(microbatch, role_swap, consolidate, restart, escalation) decide them; the simulator
(greyhound.sim.mitigation) and the training framework apply them, so the types live here, below
both.
"""

from __future__ import annotations

from dataclasses import dataclass


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


def even_split(total: int, groups: int, multiple_of: int = 1) -> tuple[int, ...]:
    """Megatron's default split of M micro-batches over the DP groups, the remainder to the first
    groups: what a job runs before any S2 plan and returns to when one is reverted.

    ``multiple_of``: a job whose micro-batches go to its groups in units (e.g. of the pipeline
    depth) splits M / unit units; M not a multiple of the unit leaves the rest out, as the job
    itself does."""
    base, extra = divmod(total // multiple_of, groups)
    return tuple((base + (1 if i < extra else 0)) * multiple_of for i in range(groups))
