"""The NCCL-level record of one simulated iteration, as the hook would have written it.

Records are kept as parallel numpy arrays per kind of call (one :class:`EventBlock` each), not as
Python objects per call: a 4,096-GPU iteration holds about 200,000 calls.

Every call has two timelines, as on a real GPU (NCCL calls are asynchronous): the host's, where
the training thread enqueues the call and returns microseconds later, running ahead of the GPU
until the iteration's synchronisation; and the GPU's, where the rank's stream reaches the call
(its arrival at the collective) and completes it. Waits, lateness and hangs live on the GPU
timeline; the host timeline only says what was enqueued when.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import numpy.typing as npt

from greyhound.core.arrays import FloatArray, IntArray


class Op(IntEnum):
    """NCCL calls the simulated job makes (codes local to the simulator; live mode maps them)."""

    ALLREDUCE = 0
    ALLGATHER = 1
    SEND = 2
    RECV = 3


class CommKind(IntEnum):
    TP = 0
    DP = 1
    PP = 2


BYTES_PER_ELEMENT = 2  # bf16 gradients and activations


@dataclass(frozen=True, slots=True, eq=False)
class EventBlock:
    """One kind of call across all ranks. Times are absolute virtual seconds; ``inf`` = never.

    ``rank`` is the global rank in Megatron order, ``gpu`` the GPU hosting it (they differ after
    a mitigation moved ranks), ``comm`` the communicator id (see :class:`CommTable`), ``seq``
    the per-(rank, communicator) call number, ``peer`` the peer rank of a send/recv or -1.
    ``gpu_start``/``gpu_end``: when the rank's GPU reaches the call and when the call completes
    there. ``host_enter``/``host_return``: when the rank's host enqueues it and returns from the
    NCCL API (a few microseconds later); a rank's calls are enqueued in the order its GPU runs
    them, so sorting a rank's calls by ``host_enter`` gives its program order.
    """

    op: npt.NDArray[np.int8]
    rank: IntArray
    gpu: IntArray
    comm: IntArray
    seq: IntArray
    nbytes: IntArray
    peer: IntArray
    gpu_start: FloatArray
    gpu_end: FloatArray
    host_enter: FloatArray
    host_return: FloatArray

    def __len__(self) -> int:
        return len(self.rank)

    @property
    def count(self) -> IntArray:
        return self.nbytes // BYTES_PER_ELEMENT


@dataclass(frozen=True, slots=True)
class CommTable:
    """Communicator ids: TP groups first (index pp*DP + dp), then DP (pp*TP + tp), then PP (dp*TP + tp)."""

    tp: int
    dp: int
    pp: int

    @property
    def dp_base(self) -> int:
        return self.pp * self.dp

    @property
    def pp_base(self) -> int:
        return self.dp_base + self.pp * self.tp

    @property
    def size(self) -> int:
        return self.pp_base + self.dp * self.tp

    def kind(self, comm: int) -> CommKind:
        if not 0 <= comm < self.size:
            raise IndexError(comm)
        if comm < self.dp_base:
            return CommKind.TP
        return CommKind.DP if comm < self.pp_base else CommKind.PP

    def members(self, comm: int) -> IntArray:
        """Global ranks of a communicator, in communicator-rank order."""
        tp, dp, pp = self.tp, self.dp, self.pp
        kind = self.kind(comm)
        if kind is CommKind.TP:
            s, d = divmod(comm, dp)
            return np.arange(tp, dtype=np.int64) + tp * (d + dp * s)
        if kind is CommKind.DP:
            s, t = divmod(comm - self.dp_base, tp)
            return t + tp * (np.arange(dp, dtype=np.int64) + dp * s)
        d, t = divmod(comm - self.pp_base, tp)
        return t + tp * (d + dp * np.arange(pp, dtype=np.int64))


@dataclass(frozen=True, slots=True, eq=False)
class IterationTiming:
    """One iteration: when it ran, how long it took, and every NCCL call of every rank.

    ``compute_s`` and ``comm_s`` are per-rank GPU busy times (own kernels, time in NCCL calls);
    ``blocks`` is empty when the caller asked for timings only. ``hung`` means the iteration
    never finishes (``duration_s`` is then ``inf``). ``dp_algorithm`` is what NCCL picked for
    each stage's DP all-reduce ("ring" or "tree").
    """

    index: int
    start_s: float
    duration_s: float
    compute_s: FloatArray
    comm_s: FloatArray
    blocks: tuple[EventBlock, ...]
    hung: bool
    dp_algorithm: tuple[str, ...]

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s

    def events(self) -> EventBlock:
        """All blocks concatenated (for consumers that want one table)."""
        if not self.blocks:
            empty_i = np.zeros(0, dtype=np.int64)
            empty_f = np.zeros(0)
            return EventBlock(np.zeros(0, dtype=np.int8), *(empty_i,) * 6,
                              *(empty_f.copy() for _ in range(4)))
        cols = [np.concatenate([getattr(b, f) for b in self.blocks]) for f in EventBlock.__slots__]
        return EventBlock(*cols)
