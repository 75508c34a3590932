"""Which clock a profiling window's calls are timed on: the GPU's where the hook timed them.

NCCL calls are asynchronous. The host enqueues a collective and returns within microseconds,
long before the collective runs, so host enter/return times say nothing about when a rank
arrived at a collective or how long it took: a compute straggler's host enters every collective
with its peers, and only its GPU reaches the collective late. A call's arrival is therefore its
GPU start (when the rank's stream reached it) and its completion its GPU end.

A call without GPU times (captured in a CUDA graph, or its timing dropped) is excluded rather
than mixed in: its host times are on another timeline. A rank with no GPU-timed call at all (a
host-only process, where NCCL calls block the host and host times are the truth) is used on host
time. Excluding a call leaves a hole in its rank's sequence: the gap before the next call would
span the missing one, so that gap is marked unknown rather than counted as the rank's own delay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from greyhound.core.arrays import IntArray

TimingBasis = Literal["gpu", "host", "mixed", "none"]


@dataclass(frozen=True, slots=True, eq=False)
class Timeline:
    """Per input row: whether it is used, and for used rows the arrival and completion times
    (``enter_ns``/``exit_ns``, 0 for unused rows) and whether the rank's previous call (in host
    enqueue order) is used too, so the gap since it means something (``gap_known``)."""

    keep: NDArray[np.bool_]
    enter_ns: IntArray
    exit_ns: IntArray
    gap_known: NDArray[np.bool_]
    basis: TimingBasis
    gpu_rows: int
    host_only_rows: int
    excluded_rows: int

    def summary(self) -> dict[str, object]:
        return {"basis": self.basis, "gpu_rows": self.gpu_rows,
                "host_only_rows": self.host_only_rows, "excluded_rows": self.excluded_rows}


def choose_timeline(rank: IntArray, host_enter_ns: IntArray, host_exit_ns: IntArray,
                    gpu_start_ns: IntArray, gpu_end_ns: IntArray) -> Timeline:
    """GPU times for GPU-timed rows, host times for ranks with none, the rest excluded.
    Times are int64 ns on one clock per rank; a GPU time of 0 means "not timed"."""
    rank = np.asarray(rank, dtype=np.int64)
    host_enter = np.asarray(host_enter_ns, dtype=np.int64)
    start = np.asarray(gpu_start_ns, dtype=np.int64)
    end = np.asarray(gpu_end_ns, dtype=np.int64)
    n = len(rank)
    timed = (start > 0) & (end >= start)
    if n == 0:
        empty = np.zeros(0, bool)
        return Timeline(empty, np.zeros(0, np.int64), np.zeros(0, np.int64), empty, "none",
                        0, 0, 0)
    rank_values, rank_code = np.unique(rank, return_inverse=True)
    has_gpu = np.bincount(rank_code[timed], minlength=len(rank_values)) > 0
    host_only = ~has_gpu[rank_code]
    keep = timed | host_only
    enter = np.where(timed, start, np.where(host_only, host_enter, 0))
    exit_ = np.where(timed, end, np.where(host_only, np.asarray(host_exit_ns, np.int64), 0))
    # a used row whose predecessor on its rank (host enqueue order) was excluded: gap unknown
    order = np.lexsort((np.arange(n), host_enter, rank_code))
    same_rank = rank_code[order][1:] == rank_code[order][:-1]
    gap_known = np.ones(n, bool)
    gap_known[order[1:]] = ~same_rank | keep[order[:-1]]
    gpu_rows = int(np.count_nonzero(timed))
    host_rows = int(np.count_nonzero(host_only))
    basis: TimingBasis = ("gpu" if host_rows == 0 else "host" if gpu_rows == 0 else "mixed")
    return Timeline(keep, enter, exit_, gap_known & keep, basis, gpu_rows, host_rows,
                    n - gpu_rows - host_rows)
