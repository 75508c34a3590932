"""The simulator's calls as the hook's ring records (numpy in, numpy out; no files, no clocks).

The cluster model numbers calls its own way (0-based per-communicator sequence, small comm
indices, virtual seconds); the hook writes NCCL's view: 1-based collective sequence per
communicator, per-peer send/recv counts for P2P, 64-bit communicator ids, element counts and
CLOCK_MONOTONIC nanoseconds. :class:`RecordCodec` does that translation for whole iterations at
once, keeping the per-peer counters across iterations as the hook's comm table does.

``enter_ns``/``return_ns`` are the host's (the enqueue, microseconds long) and
``gpu_start_ns``/``gpu_end_ns`` the GPU's (``NEVER_NS`` when that never happens); flags are
left to the writer, which decides, as the hook does, whether a call is profiled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from greyhound import hookabi
from greyhound.core.arrays import IntArray
from greyhound.sim.events import CommKind, CommTable, EventBlock, Op

U64 = npt.NDArray[np.uint64]

NEVER_NS = np.iinfo(np.uint64).max  # an enter or return that does not happen
NCCL_BFLOAT16 = 9
NCCL_SUM = 0
COMM_ID_TAG = 0x51AD << 48  # ids look like the hook's hashes, and say their kind (bits 32..39)

HOOK_OP = np.zeros(max(Op) + 1, dtype=np.uint16)
HOOK_OP[Op.ALLREDUCE] = hookabi.Op.ALLREDUCE
HOOK_OP[Op.ALLGATHER] = hookabi.Op.ALLGATHER
HOOK_OP[Op.SEND] = hookabi.Op.SEND
HOOK_OP[Op.RECV] = hookabi.Op.RECV


def comm_ids(comms: CommTable) -> U64:
    """One nonzero 64-bit id per simulated communicator; ``(id >> 32) & 0xff`` is its CommKind."""
    index = np.arange(comms.size, dtype=np.uint64)
    kind = np.array([int(comms.kind(i)) for i in range(comms.size)], dtype=np.uint64)
    return np.uint64(COMM_ID_TAG) | (kind << np.uint64(32)) | (index + np.uint64(1))


def comm_kind(comm_id: int) -> CommKind:
    return CommKind((comm_id >> 32) & 0xFF)


def comm_kinds(comm_id: U64) -> IntArray:
    """:func:`comm_kind` of many ids at once, as plain integers (a comm table's row index)."""
    return ((comm_id >> np.uint64(32)) & np.uint64(0xFF)).astype(np.int64)


@dataclass(frozen=True, slots=True)
class RankCoords:
    """Where each global rank sits in its three communicators (Megatron order)."""

    tp: IntArray
    dp: IntArray
    pp: IntArray

    @classmethod
    def of(cls, comms: CommTable) -> RankCoords:
        r = np.arange(comms.tp * comms.dp * comms.pp, dtype=np.int64)
        return cls(r % comms.tp, (r // comms.tp) % comms.dp, r // (comms.tp * comms.dp))


class RecordCodec:
    """Encodes iterations into RECORD_DTYPE rows sorted by (rank, host enter time).

    ``mono_base_ns`` is the monotonic time of virtual second 0. Returns the rank of each row
    alongside (the ring of a rank is its own file, so rows carry no global rank).
    """

    def __init__(self, comms: CommTable, mono_base_ns: int, *, pid: int) -> None:
        self.comms = comms
        self.ids = comm_ids(comms)
        self.coords = RankCoords.of(comms)
        self.mono_base_ns = mono_base_ns
        self.pid = pid
        world = comms.tp * comms.dp * comms.pp
        self._pairs = np.zeros((world, 2), dtype=np.int64)  # sends so far, [sender, peer > sender]

    def ns(self, t: npt.NDArray[np.float64]) -> U64:
        """Virtual seconds to monotonic ns; ``inf`` (never) to NEVER_NS."""
        out = np.full(t.shape, NEVER_NS, dtype=np.uint64)
        ok = np.isfinite(t)
        out[ok] = (self.mono_base_ns + np.rint(t[ok] * 1e9)).astype(np.uint64)
        return out

    def encode(self, blocks: tuple[EventBlock, ...]) -> tuple[IntArray, np.ndarray]:
        if not blocks:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=hookabi.RECORD_DTYPE)
        seqs = self._seqs(blocks)
        ev = _concat(blocks)
        seq = np.concatenate(seqs)
        rec = np.zeros(len(ev.rank), dtype=hookabi.RECORD_DTYPE)
        kind = np.where(ev.comm < self.comms.dp_base, CommKind.TP,
                        np.where(ev.comm < self.comms.pp_base, CommKind.DP, CommKind.PP))
        c = self.coords
        rec["comm_id"] = self.ids[ev.comm]
        rec["count"] = ev.count
        rec["seq"] = seq
        rec["enter_ns"] = self.ns(ev.host_enter)
        rec["return_ns"] = self.ns(ev.host_return)
        rec["gpu_start_ns"] = self.ns(ev.gpu_start)
        rec["gpu_end_ns"] = self.ns(ev.gpu_end)
        rec["stream"] = 0x7F00_0000_0000 + ev.rank.astype(np.uint64) * 0x100
        rec["comm_rank"] = np.choose(kind, [c.tp[ev.rank], c.dp[ev.rank], c.pp[ev.rank]])
        rec["nranks"] = np.choose(kind, [self.comms.tp, self.comms.dp, self.comms.pp])
        p2p = (ev.op == Op.SEND) | (ev.op == Op.RECV)
        rec["peer"] = np.where(p2p, c.pp[np.maximum(ev.peer, 0)], -1)
        rec["op"] = HOOK_OP[ev.op]
        rec["datatype"] = NCCL_BFLOAT16
        rec["redop"] = np.where(ev.op == Op.ALLREDUCE, NCCL_SUM, hookabi.NO_REDOP)
        rec["tid"] = self.pid
        order = np.lexsort((rec["gpu_start_ns"], rec["enter_ns"], ev.rank))
        return ev.rank[order], rec[order]

    def _seqs(self, blocks: tuple[EventBlock, ...]) -> list[IntArray]:
        """Collectives: the 1-based per-comm sequence. P2P: the 1-based count of calls between
        the same sender and receiver, the same number on both sides of a transfer (the model
        emits each receive block followed by its matching send block, row for row)."""
        out: list[IntArray] = []
        i = 0
        while i < len(blocks):
            b = blocks[i]
            if b.op.size and b.op[0] == Op.RECV:
                send = blocks[i + 1]
                if len(send) != len(b) or not np.all(send.op == Op.SEND):
                    raise ValueError("a receive block must be followed by its send block")
                seq = self._pair_seq(send.rank, send.peer, send.host_enter)
                out += [seq, seq.copy()]
                i += 2
                continue
            out.append(b.seq.astype(np.int64) + 1)
            i += 1
        return out

    def _pair_seq(self, sender: IntArray, receiver: IntArray,
                  enter: npt.NDArray[np.float64]) -> IntArray:
        key = sender * 2 + (receiver > sender)
        order = np.lexsort((enter, key))
        k = key[order]
        first = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
        sizes = np.diff(np.r_[first, len(k)])
        local = np.arange(len(k)) - np.repeat(first, sizes)
        flat = self._pairs.reshape(-1)
        seq = np.empty(len(k), dtype=np.int64)
        seq[order] = flat[k] + local + 1
        np.add.at(flat, k[first], sizes)
        return seq


def _concat(blocks: tuple[EventBlock, ...]) -> EventBlock:
    cols = [np.concatenate([getattr(b, f) for b in blocks]) for f in EventBlock.__slots__]
    return EventBlock(*cols)
