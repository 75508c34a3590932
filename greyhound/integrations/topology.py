"""The framework-free half of applying an S3 plan inside a running job: who runs which rank, which
processes hold which groups, whose state must move where.

Vocabulary (the plan contract, docs/mitigation.md): a *rank* is a role, ``rank = tp + TP * (dp +
DP * pp)`` as Megatron orders them; a *GPU* ``g`` is the training process of global rank ``g``
(one process per GPU, numbered along the nodes as torchrun numbers them), so ``gpu_of_rank[r]``
is the process that runs rank ``r``. A process never changes its global rank (its NCCL
communicators, its hook ring and its launcher keep it); an S3 plan changes the role it plays.

Moving a role moves its state: the parameters and optimizer state of a stage live in the
processes of that stage. DP replicas of one stage hold the same state (plain data parallelism),
so a process that moves to another DP group of its own stage keeps its state; a process that
changes stage (or TP shard) receives the state of its new rank from the process that ran that
rank before. With a sharded optimizer (ZeRO, Megatron's distributed optimizer) the replicas
differ and every changed role moves.

Torch orders a process group's members by global rank, and that order is the group's rank
order: a TP group's shards must therefore sit on ascending processes (``tp`` 0 on the lowest),
and so must a DP group's when the optimizer is sharded over it. A plan that breaks that order
cannot be expressed with torch's groups and is refused (:func:`check_group_order`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from greyhound.core.layout import ParallelShape, checked_layout

GROUP_KINDS = ("tp", "dp", "pp")


class LayoutError(ValueError):
    """A layout the job cannot run (not a permutation, wrong size, an order torch cannot keep)."""


@dataclass(frozen=True, slots=True)
class Delivery:
    """One plan version as the job receives it (``GET /v1/jobs/{id}/plan`` or ``gh.v1.<job>.plan``).

    The state is absolute: ``microbatches`` per DP group (None: the job's own even split) and
    ``gpu_of_rank`` (None: rank r on GPU r), so a job that missed a version still lands right."""

    version: int
    microbatches: tuple[int, ...] | None = None
    gpu_of_rank: tuple[int, ...] | None = None
    swaps: tuple[tuple[int, int], ...] = ()
    strategy: str = ""
    action: str = ""

    @classmethod
    def parse(cls, data: Delivery | Mapping[str, Any]) -> Delivery:
        if isinstance(data, Delivery):
            return data
        version = data.get("version", 0)
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"plan: version must be a non-negative integer, got {version!r}")
        return cls(version, _ints(data.get("microbatches"), "microbatches"),
                   _ints(data.get("gpu_of_rank"), "gpu_of_rank"),
                   tuple((int(a), int(b)) for a, b in data.get("swaps") or ()),
                   str(data.get("strategy") or ""), str(data.get("action") or ""))


def _ints(value: object, what: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise ValueError(f"plan: {what} must be a list of integers or null, got {value!r}")
    if any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise ValueError(f"plan: {what} must hold integers only, got {list(value)!r}")
    return tuple(value)


@dataclass(frozen=True, slots=True)
class Role:
    """What one process does: its rank and that rank's pipeline stage, DP group and TP index."""

    rank: int
    stage: int
    dp: int
    tp: int


@dataclass(frozen=True, slots=True)
class Transfer:
    """Process ``dst`` takes rank ``role``, whose state process ``src`` holds."""

    src: int
    dst: int
    role: Role


@dataclass(frozen=True, slots=True)
class LayoutOutcome:
    """What one delivered version did to the job (every process records it; rank 0 reports)."""

    version: int
    applied: bool
    cost_s: float  # the slowest process's pause, boundary to training again
    error: str | None
    iteration: int  # the first iteration run under it (or that would have been)
    layout_changed: bool
    moved: tuple[int, ...]  # processes that received another rank's state
    bytes_moved: int  # summed over the processes


def layout(shape: ParallelShape, gpu_of_rank: Sequence[int] | None) -> tuple[int, ...]:
    """The rank -> process map, checked (None: the identity)."""
    try:
        return tuple(int(g) for g in checked_layout(shape, gpu_of_rank))
    except ValueError as exc:
        raise LayoutError(str(exc)) from None


def role_of(shape: ParallelShape, rank: int) -> Role:
    stage, dp, tp = (int(x) for x in shape.coords(rank))
    return Role(rank, stage, dp, tp)


def roles(shape: ParallelShape, gpu_of_rank: Sequence[int]) -> tuple[Role, ...]:
    """Each process's role, indexed by process (global rank)."""
    rank_of = np.empty(shape.world, dtype=np.int64)
    rank_of[np.asarray(gpu_of_rank, dtype=np.int64)] = np.arange(shape.world)
    return tuple(role_of(shape, int(r)) for r in rank_of)


def group_members(shape: ParallelShape, gpu_of_rank: Sequence[int]) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Every TP, DP and PP group as the processes it holds, each in role order (tp, dp or stage
    index 0 first), groups in a fixed order: every process creates them in this order."""
    g = gpu_of_rank
    r = shape.rank
    return {
        "tp": tuple(tuple(g[r(s, d, t)] for t in range(shape.tp))
                    for s in range(shape.pp) for d in range(shape.dp)),
        "dp": tuple(tuple(g[r(s, d, t)] for d in range(shape.dp))
                    for s in range(shape.pp) for t in range(shape.tp)),
        "pp": tuple(tuple(g[r(s, d, t)] for s in range(shape.pp))
                    for d in range(shape.dp) for t in range(shape.tp)),
    }


def check_group_order(shape: ParallelShape, gpu_of_rank: Sequence[int],
                      kinds: Sequence[str] = ("tp",)) -> None:
    """Refuse a layout whose order-sensitive groups would not be ascending in process rank."""
    members = group_members(shape, gpu_of_rank)
    for kind in kinds:
        for group in members[kind]:
            if list(group) != sorted(group):
                raise LayoutError(
                    f"{kind.upper()} group on processes {list(group)} (in {kind} order) is not "
                    f"ascending: torch orders a group by global rank, so its {kind} indices would "
                    "change under the state they hold")


def transfers(shape: ParallelShape, before: Sequence[int], after: Sequence[int], *,
              replicated_dp: bool = True) -> tuple[Transfer, ...]:
    """The state each process must receive to go from layout ``before`` to ``after``."""
    old, new = roles(shape, before), roles(shape, after)
    out = []
    for p in range(shape.world):
        a, b = old[p], new[p]
        if a.rank == b.rank or (replicated_dp and (a.stage, a.tp) == (b.stage, b.tp)):
            continue
        out.append(Transfer(src=int(before[b.rank]), dst=p, role=b))
    return tuple(out)
