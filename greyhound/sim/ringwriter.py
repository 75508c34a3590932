"""One simulated rank's ring file, written the way native/hook writes it.

The file itself (header, offsets, control block, temporary name then rename) comes from
``hookabi.RingWriter``; records are put in with the hook's rule (``write_records``). The comm
table is not kept here: the hook's counters of every rank move together in virtual time, so
:class:`greyhound.sim.commtable.CommTables` keeps them for all ranks at once and this class only
copies a rank's rows into its file. Each simulated rank belongs to exactly three communicators
(TP, DP, PP); their rows are registered at creation, as ``ncclCommInitRank`` would, in the row of
their CommKind, with GPU completion marks on (the hook's poller records them on every call).
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


@dataclass(frozen=True, slots=True)
class CommRow:
    comm_id: int
    rank: int  # this rank's index in the communicator
    nranks: int
    peers: tuple[int, ...] = ()  # P2P peers (comm ranks), registered in this order


class SimRing:
    """A rank's ring: publish records, overwrite its comm rows."""

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
            row["gpu_marks"] = 1
            row["state"] = int(hookabi.CommState.ACTIVE)
        self.nrows = 1 + max(int(comm_kind(c.comm_id)) for c in comms) if comms else 0
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

    def rows(self) -> np.ndarray:
        """A copy of the registered comm rows (row i: the communicator of CommKind i)."""
        out: np.ndarray = self._map.comm_table[: self.nrows].copy()
        return out

    def set_rows(self, rows: np.ndarray) -> None:
        self._map.comm_table[: self.nrows] = rows

    def publish(self, records: np.ndarray) -> int:
        """Records in this rank's call order; what does not fit is dropped and counted."""
        return write_records(self._map, records)

    def close(self) -> None:
        del self.control
        self._map.close()
