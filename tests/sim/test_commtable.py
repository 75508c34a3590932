"""The comm table moves as the hook moves it: host counters at enqueue and return, GPU
completion marks oldest first per communicator, the oldest pending call described."""

from __future__ import annotations

import numpy as np

from greyhound import hookabi
from greyhound.hookabi import Op
from greyhound.sim.commtable import CommTables, Progress
from greyhound.sim.records import COMM_ID_TAG

PP_COMM = COMM_ID_TAG | (2 << 32) | 7
TP_COMM = COMM_ID_TAG | (0 << 32) | 3


def calls() -> tuple[np.ndarray, np.ndarray]:
    """Rank 0, a middle pipeline stage (comm rank 1 of 3): a TP all-reduce, then a send to the
    next stage and a receive from the previous one."""
    rec = np.zeros(3, hookabi.RECORD_DTYPE)
    rec["comm_id"] = [TP_COMM, PP_COMM, PP_COMM]
    rec["op"] = [Op.ALLREDUCE, Op.SEND, Op.RECV]
    rec["seq"] = [5, 1, 1]
    rec["count"] = [100, 200, 200]
    rec["datatype"] = 9
    rec["comm_rank"] = [0, 1, 1]
    rec["peer"] = [-1, 2, 0]
    rec["enter_ns"] = [1_000, 2_000, 3_000]
    rec["return_ns"] = [1_005, 2_005, 3_005]
    return np.zeros(3, np.int64), rec


def tables() -> CommTables:
    rows = np.zeros((1, 3), hookabi.COMM_DTYPE)
    rows["comm_id"][0] = [TP_COMM, 0, PP_COMM]
    return CommTables(rows)


def test_host_counters_move_at_enqueue_and_return() -> None:
    t = tables()
    rank, rec = calls()
    state = np.zeros(3, np.uint8)
    no = np.zeros(3, bool)
    state = t.update(rank, rec, state, entered=np.array([True, False, False]), returned=no,
                     finished=no)
    tp = t.rows[0, 0]
    assert (tp["calls_entered"], tp["calls_completed"], tp["last_seq_entered"]) == (1, 0, 5)
    assert (tp["last_op"], tp["last_count"], tp["last_dtype"]) == (Op.ALLREDUCE, 100, 9)
    assert t.inflight_ns[0, 0] == 1_000  # inside the API call, for its microseconds
    every = np.ones(3, bool)
    state = t.update(rank, rec, state, entered=every, returned=every, finished=no)
    tp, pp = t.rows[0, 0], t.rows[0, 2]
    assert (tp["calls_completed"], tp["last_seq_completed"]) == (1, 5)
    assert not t.inflight_ns.any()
    assert (pp["calls_entered"], pp["calls_completed"], pp["last_seq_entered"]) == (2, 2, 0)
    assert pp["send_count"][1] == 1 and pp["recv_count"][0] == 1  # next stage slot 1, prev 0
    assert np.all(state & (Progress.ENTERED | Progress.RETURNED) != 0)


def test_gpu_marks_count_in_enqueue_order_and_name_the_oldest_pending_call() -> None:
    t = tables()
    rank, rec = calls()
    every = np.ones(3, bool)
    # The receive completed on the GPU but the send before it did not: the poller stops there.
    state = t.update(rank, rec, np.zeros(3, np.uint8), entered=every, returned=every,
                     finished=np.array([True, False, True]))
    tp, pp = t.rows[0, 0], t.rows[0, 2]
    assert (tp["gpu_calls_done"], tp["gpu_seq_done"], tp["gpu_pending_op"]) == (1, 5, 0)
    assert pp["gpu_calls_done"] == 0 and pp["gpu_seq_done"] == 0
    assert (pp["gpu_pending_op"], pp["gpu_pending_seq"], pp["gpu_pending_count"],
            pp["gpu_pending_dtype"]) == (Op.SEND, 0, 200, 9)
    assert t.pending_ns[0, 2] == 2_000 and t.pending_ns[0, 0] == 0
    assert [bool(s & Progress.DONE) for s in state] == [True, False, False]
    state = t.update(rank, rec, state, entered=every, returned=every, finished=every)
    pp = t.rows[0, 2]
    assert pp["gpu_calls_done"] == 2 and pp["gpu_pending_op"] == 0 and t.pending_ns[0, 2] == 0
    assert np.all(state & Progress.DONE != 0)


def test_a_call_not_enqueued_is_not_pending() -> None:
    t = tables()
    rank, rec = calls()
    entered = np.array([True, False, False])
    t.update(rank, rec, np.zeros(3, np.uint8), entered=entered, returned=entered,
             finished=entered)
    assert t.rows[0, 2]["gpu_pending_op"] == 0 and t.rows[0, 2]["calls_entered"] == 0


def test_shown_ages_read_virtual_time_on_the_readers_clock() -> None:
    t = tables()
    rank, rec = calls()
    every = np.ones(3, bool)
    t.update(rank, rec, np.zeros(3, np.uint8), entered=every, returned=every,
             finished=np.zeros(3, bool))
    shown = t.shown(mono_now_ns=50_000_000, virtual_now_ns=1_000_000)
    # virtual age of the TP call: 1_000_000 - 1_000 ns
    assert shown[0, 0]["gpu_pending_ns"] == 50_000_000 - (1_000_000 - 1_000)
    assert shown[0, 1]["gpu_pending_ns"] == 0 and t.rows[0, 0]["gpu_pending_ns"] == 0
    t.clear()
    assert not t.shown(50_000_000, 1_000_000)["gpu_pending_ns"].any()
