"""Choosing each rank's timeline for a profiling window: GPU times where the hook timed a call,
host times only for a rank with no GPU-timed call, untimed calls of GPU ranks excluded."""

from __future__ import annotations

import numpy as np

from greyhound.core.gpu_timeline import choose_timeline


def test_gpu_rows_are_used_untimed_ones_excluded_and_host_only_ranks_kept() -> None:
    rank = np.array([0, 0, 0, 1, 1, 0])
    host_enter = np.array([10, 20, 30, 11, 21, 40])
    host_exit = host_enter + 1
    gpu_start = np.array([15, 0, 35, 0, 0, 45])  # rank 0's 2nd call untimed; rank 1 host-only
    gpu_end = np.array([18, 0, 38, 0, 0, 48])
    t = choose_timeline(rank, host_enter, host_exit, gpu_start, gpu_end)
    assert t.keep.tolist() == [True, False, True, True, True, True]
    assert t.enter_ns[t.keep].tolist() == [15, 35, 11, 21, 45]
    assert t.exit_ns[t.keep].tolist() == [18, 38, 12, 22, 48]
    # the call after the excluded one has no gap; the one after that does
    assert t.gap_known.tolist() == [True, False, False, True, True, True]
    assert (t.basis, t.gpu_rows, t.host_only_rows, t.excluded_rows) == ("mixed", 3, 2, 1)
    assert t.summary() == {"basis": "mixed", "gpu_rows": 3, "host_only_rows": 2,
                           "excluded_rows": 1}


def test_gap_order_follows_host_enqueue_not_row_order() -> None:
    rank = np.array([3, 3, 3])
    host_enter = np.array([30, 10, 20])  # rows arrive out of order
    gpu_start = np.array([31, 11, 0])  # the middle call (host 20) is untimed
    t = choose_timeline(rank, host_enter, host_enter + 1, gpu_start, gpu_start + 2)
    assert t.keep.tolist() == [True, True, False]
    assert t.gap_known.tolist() == [False, True, False]
    assert t.basis == "gpu"


def test_an_end_before_its_start_is_not_a_gpu_time() -> None:
    t = choose_timeline(np.array([0, 0]), np.array([1, 2]), np.array([2, 3]),
                        np.array([5, 9]), np.array([7, 4]))
    assert t.keep.tolist() == [True, False] and t.excluded_rows == 1


def test_empty_window() -> None:
    z = np.zeros(0, np.int64)
    t = choose_timeline(z, z, z, z, z)
    assert t.basis == "none" and len(t.keep) == 0
