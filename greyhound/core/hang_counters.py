"""The hang diagnosis's inputs from sampled per-communicator counters, on the GPU timeline.

NCCL calls are asynchronous: the host enqueues a collective and returns within microseconds, runs
ahead, and blocks later in a synchronisation outside NCCL. So the three questions the diagnosis
asks of each (communicator, rank) are answered from two timelines:

  entered    what the host enqueued (its collective sequence number): a rank whose host never
             enqueued the call is H1's culprit;
  completed  the newest collective the GPU finished (the hook's completion marks);
  busy       the GPU is inside a call on this communicator: its oldest call not done on the GPU.

Two corrections turn the host's count into what the GPU actually faces. The host may have run
past the hung call (enqueued later ones on the same communicator), so a rank's count is capped
at the communicator's stuck point, the first sequence some member has not completed: every
member is then compared at the call it is stuck in, with that call's op, count and datatype from
the pending-call fields (H2), not the host's newest. And a GPU executes a stream in order, so a
call enqueued after the rank's oldest pending call (on another communicator) has not been
reached: on that communicator the rank counts as not there yet and not busy, which makes it a
symptom of the communicator where its GPU really waits, as a blocked host made it before.

Rows without completion marks (a host-only process: NCCL calls block the host) keep the host
semantics: completed at host return, busy while a host thread is inside the call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from greyhound.core.arrays import FloatArray, IntArray
from greyhound.core.hang_diagnosis import CommCounters, LastRecords
from greyhound.core.localize import codes

NO_OP = "none"  # the op name of an empty pending-call slot


@dataclass(frozen=True, slots=True, eq=False)
class SampledCounters:
    """One element per (communicator, rank), as agents sample them (a CounterBatch's columns).

    Host side: ``calls_entered``/``calls_completed`` count every call, ``seq_entered``/
    ``seq_completed`` the collectives (1-based, 0 none yet), ``inflight_s`` a host thread's time
    inside NCCL, ``last_*`` the host's newest call. GPU side (used where ``gpu_marks``):
    ``gpu_seq_completed`` the newest collective done on the GPU, ``gpu_pending_*`` the oldest call
    not done there (its age, 1-based seq or 0 for a send/receive, op name, count, datatype).
    """

    comm_id: IntArray
    rank: IntArray
    calls_entered: IntArray
    calls_completed: IntArray
    seq_entered: IntArray
    seq_completed: IntArray
    inflight_s: FloatArray
    last_op: NDArray[Any]
    last_count: IntArray
    last_dtype: IntArray
    gpu_marks: NDArray[np.bool_]
    gpu_seq_completed: IntArray
    gpu_pending_s: FloatArray
    gpu_pending_seq: IntArray
    gpu_pending_op: NDArray[Any]
    gpu_pending_count: IntArray
    gpu_pending_dtype: IntArray

    def __post_init__(self) -> None:
        for name in ("comm_id", "rank", "calls_entered", "calls_completed", "seq_entered",
                     "seq_completed", "last_count", "last_dtype", "gpu_seq_completed",
                     "gpu_pending_seq", "gpu_pending_count", "gpu_pending_dtype"):
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=np.int64))
        for name in ("inflight_s", "gpu_pending_s"):
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=np.float64))
        for name in ("last_op", "gpu_pending_op"):
            object.__setattr__(self, name, np.asarray(getattr(self, name)).astype(str))
        object.__setattr__(self, "gpu_marks", np.asarray(self.gpu_marks, dtype=bool))
        n = len(self.comm_id)
        if any(len(getattr(self, f)) != n for f in self.__slots__):
            raise ValueError("SampledCounters arrays must have equal lengths")

    def __len__(self) -> int:
        return len(self.comm_id)

    def basis(self) -> str:
        """Where the rows were read: "gpu" (completion marks), "host" (none) or "mixed"."""
        marked = int(np.count_nonzero(self.gpu_marks))
        return "gpu" if marked == len(self) else "host" if marked == 0 else "mixed"


def diagnosis_inputs(s: SampledCounters, *, now_ns: int,
                     stalled_s: float) -> tuple[CommCounters, LastRecords]:
    """Counters and last records for ``diagnose_hang``. Times are made up from the sample:
    a pending call (GPU) or a call inside NCCL (host) was entered its age ago; everything else
    last moved ``stalled_s`` ago, when the tracker's watch says the communicator went quiet."""
    gpu = s.gpu_marks
    waiting = gpu & ((s.gpu_pending_s > 0.0) | (s.gpu_pending_op != NO_OP))
    _, rank_code = codes(s.rank)
    oldest = np.full(int(rank_code.max(initial=-1)) + 1, -np.inf)
    np.maximum.at(oldest, rank_code[waiting], s.gpu_pending_s[waiting])
    reached = waiting & (s.gpu_pending_s >= oldest[rank_code])

    done = np.where(gpu, s.gpu_seq_completed, s.seq_completed)
    _, comm_code = codes(s.comm_id)
    stuck = np.full(int(comm_code.max(initial=-1)) + 1, np.iinfo(np.int64).max)
    np.minimum.at(stuck, comm_code[gpu], done[gpu] + 1)
    # a call queued behind the rank's oldest pending one has not been reached: entered up to done
    gpu_entered = np.minimum(np.where(reached, s.seq_entered, np.minimum(s.seq_entered, done)),
                             stuck[comm_code])
    entered = np.where(gpu, gpu_entered, s.seq_entered)
    host_in_call = (s.calls_entered > s.calls_completed) | (s.inflight_s > 0.0)
    counters = CommCounters(comm_id=s.comm_id, rank=s.rank, entered=entered, completed=done,
                            in_call=np.where(gpu, reached, host_in_call))

    quiet = now_ns - stalled_s * 1e9
    inside = ~gpu & (s.inflight_s > 0.0)
    host_enter = np.where(inside, now_ns - s.inflight_s * 1e9, quiet)
    host_exit = np.where(inside, -1.0, quiet)
    # GPU rows: the pending call, and the host's newest call when the host ran past it
    pend = np.flatnonzero(waiting)
    newest = np.flatnonzero(gpu & ~(waiting & (s.gpu_pending_seq == s.seq_entered)))
    host = np.flatnonzero(~gpu)
    rows = np.concatenate((host, pend, newest))
    seq = np.concatenate((s.seq_entered[host], s.gpu_pending_seq[pend], s.seq_entered[newest])) - 1
    op = np.concatenate((s.last_op[host], s.gpu_pending_op[pend], s.last_op[newest]))
    count = np.concatenate((s.last_count[host], s.gpu_pending_count[pend], s.last_count[newest]))
    dtype = np.concatenate((s.last_dtype[host], s.gpu_pending_dtype[pend], s.last_dtype[newest]))
    enter = np.concatenate((host_enter[host], now_ns - s.gpu_pending_s[pend] * 1e9,
                            np.full(len(newest), quiet)))
    exit_ = np.concatenate((host_exit[host], np.full(len(pend), -1.0),
                            np.where(waiting[newest], -1.0, quiet)))
    last = LastRecords(comm_id=s.comm_id[rows], rank=s.rank[rows], seq=seq, op=op, count=count,
                       dtype=dtype, enter_ns=enter, exit_ns=exit_)
    return counters, last
