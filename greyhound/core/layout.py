"""Where each rank of a TP x DP x PP job runs, and the GPU swaps that move it (S3's vocabulary).

Ranks follow Megatron's default order ``rank = tp + TP * (dp + DP * pp)``; a plan never changes
the ranks' roles, only which GPU holds each rank, so topology plans are expressed as pairs of GPUs
that exchange ranks (applied one after the other), the form the framework and the simulator take.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from greyhound.core.arrays import IntArray


@dataclass(frozen=True, slots=True)
class ParallelShape:
    tp: int
    dp: int
    pp: int

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp

    def coords(self, rank: int | IntArray) -> tuple[IntArray, IntArray, IntArray]:
        """(stage, dp group, tp index) of each rank."""
        r = np.asarray(rank, dtype=np.int64)
        return r // (self.tp * self.dp), (r // self.tp) % self.dp, r % self.tp

    def rank(self, stage: int, dp: int, tp: int) -> int:
        return tp + self.tp * (dp + self.dp * stage)


def checked_layout(shape: ParallelShape, gpu_of_rank: Sequence[int] | IntArray | None) -> IntArray:
    """The rank -> GPU map as an array (the identity when none is given), or a ValueError."""
    if gpu_of_rank is None:
        return np.arange(shape.world, dtype=np.int64)
    g = np.asarray(gpu_of_rank, dtype=np.int64)
    if g.shape != (shape.world,) or not np.array_equal(np.sort(g), np.arange(shape.world)):
        raise ValueError(f"gpu_of_rank must be a permutation of 0..{shape.world - 1}")
    return g


def swaps_between(current: IntArray, target: IntArray) -> tuple[tuple[int, int], ...]:
    """GPU pairs that, exchanged in order, turn rank -> GPU map ``current`` into ``target``.

    Each swap puts at least one GPU in its final place, so a k-cycle costs k - 1 swaps (the
    minimum); a straggler exchanged with a healthy GPU is one swap.
    """
    rank_now = np.empty_like(current)
    rank_now[current] = np.arange(len(current))
    rank_want = np.empty_like(target)
    rank_want[target] = np.arange(len(target))
    holder = current.copy()  # rank -> GPU as the swaps proceed
    out: list[tuple[int, int]] = []
    for gpu in np.flatnonzero(rank_now != rank_want):
        g = int(gpu)
        while rank_now[g] != rank_want[g]:
            other = int(holder[rank_want[g]])
            ra, rb = int(rank_now[g]), int(rank_now[other])
            rank_now[g], rank_now[other] = rb, ra
            holder[ra], holder[rb] = other, g
            out.append((min(g, other), max(g, other)))
    return tuple(out)
