"""Every simulated rank's comm table, moved as the hook moves it (numpy in, numpy out; no files).

NCCL calls are asynchronous, so a call passes three points, each of which the hook counts on its
communicator's row:

  entered   the host enqueues it: calls_entered, last_seq_entered (collectives), last_op,
            last_count, last_dtype; inflight_enter_ns while the host is inside the API call,
            which lasts microseconds (a hung collective never keeps a host thread there);
  returned  the host returns, microseconds later: calls_completed, last_seq_completed, and the
            per-peer send/recv counts (the hook bumps those at return);
  done      the GPU completes it. The poller checks a communicator's completion marks oldest
            first, so gpu_calls_done counts the calls done in enqueue order without a gap,
            gpu_seq_done is the newest collective among them, and gpu_pending_* describe the
            oldest call enqueued and not done (host enqueue time, collective seq or 0 for a
            send/receive, op, datatype, count), all 0 when there is none.

Records carry a small progress word (:class:`Progress`) that says which points were counted.
The two times the agent ages against its own monotonic clock (``inflight_enter_ns``,
``gpu_pending_ns``) are kept in virtual time here and rescaled by :meth:`CommTables.shown`.
"""

from __future__ import annotations

from enum import IntFlag

import numpy as np
import numpy.typing as npt

from greyhound import hookabi
from greyhound.core.arrays import BoolArray, IntArray
from greyhound.sim.records import comm_kinds

U64 = npt.NDArray[np.uint64]
U8 = npt.NDArray[np.uint8]


class Progress(IntFlag):
    """What happened to a simulated call so far (bits of a uint8 per record)."""

    ENTERED = 1
    RETURNED = 2
    DONE = 4  # counted done on the GPU (its communicator's earlier calls are done too)
    PUBLISHED = 8  # written to the ring
    PROFILED = 16  # the rank was in profile mode when its host enqueued the call


def _last_per(keys: IntArray) -> IntArray:
    """Position of the last occurrence of each distinct key."""
    _, idx = np.unique(keys[::-1], return_index=True)
    out: IntArray = len(keys) - 1 - idx
    return out


class CommTables:
    """The (world, rows) comm tables of every rank; ``rows`` starts as their registration."""

    def __init__(self, rows: np.ndarray) -> None:
        if rows.dtype != hookabi.COMM_DTYPE or rows.ndim != 2:
            raise ValueError("rows must be a (world, rows) COMM_DTYPE array")
        self.rows = rows
        self.inflight_ns = np.zeros(rows.shape, dtype=np.uint64)  # virtual, 0 none
        self.pending_ns = np.zeros(rows.shape, dtype=np.uint64)  # virtual, 0 none

    def update(self, rank: IntArray, rec: np.ndarray, state: U8, *, entered: BoolArray,
               returned: BoolArray, finished: BoolArray) -> U8:
        """Count what moved since the last update and return the records' new progress.

        ``rank``/``rec`` hold every call not yet retired, sorted by rank and then in the rank's
        enqueue order; ``entered``, ``returned`` and ``finished`` (done on the GPU) say what is
        true now, including what was counted before."""
        kind = comm_kinds(rec["comm_id"])  # the comm-table row: TP 0, DP 1, PP 2
        coll = ~np.isin(rec["op"], hookabi.P2P_OPS)
        new_in = entered & (state & Progress.ENTERED == 0)
        if new_in.any():
            self._entered(rank[new_in], kind[new_in], rec[new_in], coll[new_in])
        new_out = returned & (state & Progress.RETURNED == 0)
        if new_out.any():
            self._returned(rank[new_out], kind[new_out], rec[new_out], coll[new_out])
        inside = entered & ~returned
        self.inflight_ns[:] = 0
        self.inflight_ns[rank[inside], kind[inside]] = rec["enter_ns"][inside]
        state = state | np.where(entered, np.uint8(Progress.ENTERED), np.uint8(0)) \
            | np.where(returned, np.uint8(Progress.RETURNED), np.uint8(0))
        return self._gpu(rank, kind, rec, coll, state, entered, finished)

    def _entered(self, rank: IntArray, kind: IntArray, rec: np.ndarray, coll: BoolArray) -> None:
        rows = self.rows
        np.add.at(rows["calls_entered"], (rank, kind), 1)
        np.maximum.at(rows["last_seq_entered"], (rank[coll], kind[coll]), rec["seq"][coll])
        last = _last_per(rank * rows.shape[1] + kind)
        at = (rank[last], kind[last])
        rows["last_op"][at] = rec["op"][last]
        rows["last_count"][at] = rec["count"][last]
        rows["last_dtype"][at] = rec["datatype"][last]

    def _returned(self, rank: IntArray, kind: IntArray, rec: np.ndarray, coll: BoolArray) -> None:
        rows = self.rows
        np.add.at(rows["calls_completed"], (rank, kind), 1)
        np.maximum.at(rows["last_seq_completed"], (rank[coll], kind[coll]), rec["seq"][coll])
        # Peers are registered in ascending comm rank: a middle pipeline stage has its previous
        # stage in slot 0 and its next in slot 1, an end stage its one neighbour in slot 0.
        me, peer = rec["comm_rank"], rec["peer"]
        slot = ((peer > me) & (me > 0)).astype(np.int64)
        for op, field in ((hookabi.Op.SEND, "send_count"), (hookabi.Op.RECV, "recv_count")):
            sel = rec["op"] == op
            np.maximum.at(rows[field], (rank[sel], kind[sel], slot[sel]), rec["seq"][sel])

    def _gpu(self, rank: IntArray, kind: IntArray, rec: np.ndarray, coll: BoolArray, state: U8,
             entered: BoolArray, finished: BoolArray) -> U8:
        """Calls done on the GPU count in enqueue order per communicator, without a gap; the
        first one not done, if enqueued, is the pending call."""
        rows = self.rows
        open_ = np.flatnonzero(state & Progress.DONE == 0)
        key = rank[open_] * rows.shape[1] + kind[open_]
        order = np.argsort(key, kind="stable")
        sel, key = open_[order], key[order]
        start = np.ones(len(key), bool)
        start[1:] = key[1:] != key[:-1]
        bad = (~finished[sel]).astype(np.int64)
        cum = np.cumsum(bad)
        group = np.cumsum(start) - 1
        before = (cum - bad)[start]
        prefix = cum - before[group] == 0
        done = sel[prefix]
        if len(done):
            np.add.at(rows["gpu_calls_done"], (rank[done], kind[done]), 1)
            c = done[coll[done]]
            np.maximum.at(rows["gpu_seq_done"], (rank[c], kind[c]), rec["seq"][c])
            state = state.copy()
            state[done] |= np.uint8(Progress.DONE)
        after_done = np.zeros(len(key), bool)
        after_done[1:] = prefix[:-1]
        first = sel[~prefix & (start | after_done)]
        first = first[entered[first]]
        at = (rank[first], kind[first])
        for field in ("gpu_pending_seq", "gpu_pending_op", "gpu_pending_dtype",
                      "gpu_pending_count"):
            rows[field] = 0
        self.pending_ns[:] = 0
        self.pending_ns[at] = rec["enter_ns"][first]
        rows["gpu_pending_seq"][at] = np.where(coll[first], rec["seq"][first], 0)
        rows["gpu_pending_op"][at] = rec["op"][first]
        rows["gpu_pending_dtype"][at] = rec["datatype"][first]
        rows["gpu_pending_count"][at] = rec["count"][first]
        return state

    def clear(self) -> None:
        """The job ended: no host is inside NCCL and no GPU has a call pending any more."""
        self.inflight_ns[:] = 0
        self.pending_ns[:] = 0
        for field in ("gpu_pending_seq", "gpu_pending_op", "gpu_pending_dtype",
                      "gpu_pending_count"):
            self.rows[field] = 0

    def shown(self, mono_now_ns: int, virtual_now_ns: int) -> np.ndarray:
        """The rows as a reader should see them now: the agent ages inflight_enter_ns and
        gpu_pending_ns against its own monotonic clock, so they are set to ``now`` minus the
        virtual time spent since (a paced or held-back run must not look hung, nor a run faster
        than real time look new)."""
        out = self.rows.copy()
        for field, when in (("inflight_enter_ns", self.inflight_ns),
                            ("gpu_pending_ns", self.pending_ns)):
            age = np.uint64(virtual_now_ns) - np.minimum(when, np.uint64(virtual_now_ns))
            shown = np.maximum(np.int64(mono_now_ns) - age.astype(np.int64), 1)
            out[field] = np.where(when > 0, shown.astype(np.uint64), np.uint64(0))
        return out
