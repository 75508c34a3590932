"""One simulated rank's ring file, written the way native/hook writes it.

The file itself (header, offsets, control block, temporary name then rename) comes from
``hookabi.RingWriter``; this class keeps the comm table the way the hook does, which that writer
cannot express: a call counts as entered when it enters and as completed when it returns, so a
call stuck inside NCCL shows as ``calls_entered = calls_completed + 1`` with its sequence in
``last_seq_entered``, its op in ``last_op`` and its enter time in ``inflight_enter_ns``.
Each simulated rank belongs to exactly three communicators (TP, DP, PP); their rows are
registered at creation, as ``ncclCommInitRank`` would, in the row of their CommKind.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from greyhound import hookabi
from greyhound.hookabi import _Mapping  # the hook-side writer shares the reader's mapping
from greyhound.hookabi_writer import HookControl, write_records
from greyhound.sim.records import comm_kind

_P2P = (int(hookabi.Op.SEND), int(hookabi.Op.RECV))
# Layout v2 keeps the size and type of the newest call entered on each comm.
_LAST_CALL = "last_count" in (hookabi.COMM_DTYPE.names or ())


@dataclass(frozen=True, slots=True)
class CommRow:
    comm_id: int
    rank: int  # this rank's index in the communicator
    nranks: int
    peers: tuple[int, ...] = ()  # P2P peers (comm ranks), registered in this order


@dataclass(frozen=True, slots=True)
class Inflight:
    row: int
    op: int
    seq: int
    enter_ns: int
    count: int = 0
    dtype: int = 0


class SimRing:
    """A rank's ring: append completed calls, mark the one call (if any) inside NCCL."""

    def __init__(self, path: Path, *, job: str, rank: int, host: str, pid: int, device: int,
                 capacity: int, mono_anchor_ns: int, wall_anchor_ns: int,
                 comms: list[CommRow]) -> None:
        path = Path(path)
        staging = path.parent / ".staging"
        staged = staging / path.name
        hookabi.RingWriter(staged, job=job, rank=rank, host=host, pid=pid, device=device,
                           capacity=capacity).close()
        self._map = _Mapping(staged)
        hdr = self._map.hdr
        # One clock for every rank: record times are virtual seconds since the run's start.
        hdr["mono_anchor_ns"] = mono_anchor_ns
        hdr["wall_anchor_ns"] = wall_anchor_ns
        table = self._map.comm_table
        if len(comms) > hookabi.MAX_COMMS:
            raise ValueError("too many communicators for one ring")
        self.rows: dict[int, int] = {}
        self._peers: dict[int, np.ndarray] = {}
        for c in comms:
            i = int(comm_kind(c.comm_id))
            row = table[i]
            row["comm_id"] = c.comm_id
            row["rank"] = c.rank
            row["nranks"] = c.nranks
            row["color"] = -1
            row["handle"] = 0x5500_0000_0000 + rank * 0x1000 + i * 0x10
            row["peer_ids"] = -1
            row["peer_ids"][: len(c.peers)] = c.peers
            row["npeers"] = len(c.peers)
            row["state"] = int(hookabi.CommState.ACTIVE)
            self.rows[c.comm_id] = i
            self._peers[i] = np.asarray(c.peers, dtype=np.int32)
        self.inflight: Inflight | None = None
        os.replace(staged, path)  # only now may the agent see it: the anchors are final
        self._map.path = path
        self.control = HookControl(self._map.ctl)
        self.capacity = self._map.capacity

    @property
    def path(self) -> Path:
        return self._map.path

    @property
    def head(self) -> int:
        return int(self._map.hdr["head"])

    @property
    def consumed(self) -> int:
        return int(self._map.hdr["consumed"])

    @property
    def dropped(self) -> int:
        return int(self._map.hdr["dropped"])

    def lag(self) -> int:
        """Records written that the agent has not consumed yet."""
        return self.head - self.consumed

    def advance(self, records: np.ndarray, call: Inflight | None, shown_enter_ns: int = 0) -> None:
        """Calls that returned since the last advance (in this rank's call order), then the one
        call now inside NCCL, if any. ``shown_enter_ns`` is what inflight_enter_ns holds (the
        caller may rescale it, see LiveSimulation); records that do not fit are dropped and
        counted, after the comm counters, which the hook bumps whether or not a record fits."""
        old, self.inflight = self.inflight, call
        if len(records):
            self._count(records)
            self._write(records)
        table = self._map.comm_table
        if old is not None and (call is None or call.row != old.row):
            r = table[old.row]
            r["inflight_enter_ns"] = 0
            r["calls_entered"] = r["calls_completed"]
        if call is None:
            return
        r = table[call.row]
        r["calls_entered"] = int(r["calls_completed"]) + 1
        r["last_op"] = call.op
        if _LAST_CALL:
            r["last_count"] = call.count
            r["last_dtype"] = call.dtype
        if call.op not in _P2P:
            r["last_seq_entered"] = max(int(r["last_seq_entered"]), call.seq)
        r["inflight_enter_ns"] = max(1, shown_enter_ns or call.enter_ns)

    def restamp(self, mono_now_ns: int, virtual_now_ns: int) -> None:
        """Keep the call inside NCCL showing its virtual time there while the simulation stands
        still (held back by its consumer): a paced simulation must not look hung."""
        call = self.inflight
        if call is not None:
            self._map.comm_table[call.row]["inflight_enter_ns"] = max(
                1, mono_now_ns - (virtual_now_ns - call.enter_ns))

    def finish(self) -> None:
        """The simulated job ended: nothing is inside NCCL any more (as when processes exit)."""
        self.advance(np.empty(0, hookabi.RECORD_DTYPE), None)

    def _write(self, records: np.ndarray) -> None:
        write_records(self._map, records)

    def _count(self, records: np.ndarray) -> None:
        table = self._map.comm_table
        for cid in np.unique(records["comm_id"]).tolist():
            i = self.rows[int(cid)]
            mine = records[records["comm_id"] == cid]
            row = table[i]
            row["calls_completed"] += len(mine)
            row["last_op"] = int(mine["op"][-1])
            if _LAST_CALL:
                row["last_count"] = int(mine["count"][-1])
                row["last_dtype"] = int(mine["datatype"][-1])
            coll = ~np.isin(mine["op"], _P2P)
            if coll.any():
                last = int(mine["seq"][coll].max())
                row["last_seq_completed"] = last
                row["last_seq_entered"] = max(int(row["last_seq_entered"]), last)
            else:
                self._count_p2p(row, i, mine)
            busy = self.inflight is not None and self.inflight.row == i
            row["calls_entered"] = int(row["calls_completed"]) + int(busy)

    def _count_p2p(self, row: np.ndarray, i: int, mine: np.ndarray) -> None:
        """Per-peer counts: records carry each call's 1-based count with its peer, so the
        counter is the newest such number."""
        peers = self._peers[i]
        for op, field in ((hookabi.Op.SEND, "send_count"), (hookabi.Op.RECV, "recv_count")):
            sel = mine["op"] == op
            if not sel.any():
                continue
            at = np.searchsorted(peers, mine["peer"][sel])
            np.maximum.at(row[field], at, mine["seq"][sel])

    def close(self) -> None:
        del self.control
        self._map.close()
