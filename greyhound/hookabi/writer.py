"""The hook's side of a ring, in Python: the simulator plays ranks with it, tests forge rings.

It writes what native/hook writes (the file created under a temporary name and renamed once
complete, the header with its clock anchors, the communicators registered as
``ncclCommInitRank`` registers them, records under the hook's drop rule, control block answers),
so the agent cannot tell a simulated rank from a hooked process.

It does not count calls into the comm table: the hook's counters of every rank move together,
and the simulator keeps them for all ranks at once (``greyhound.sim.commtable.CommTables``),
then overwrites each ring's rows with :meth:`RingWriter.set_rows`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from greyhound.hookabi.layout import (
    COMM_DTYPE,
    CONTROL_DTYPE,
    HEADER_BYTES,
    HEADER_DTYPE,
    LAYOUT_VERSION,
    MAGIC,
    MAX_COMMS,
    MAX_PEERS,
    PROGRESS_DTYPE,
    RECORD_DTYPE,
    BenchKind,
    BenchRequest,
    BenchState,
    CommState,
    GpuApi,
    ModeName,
    mode_name,
)
from greyhound.hookabi.mapping import RingMapping

# A stand-in for the ncclComm_t pointer the hook stores (only its distinctness matters).
_HANDLE_BASE = 0x5500_0000_0000


def _page_up(n: int) -> int:
    return (n + 4095) & ~4095


class HookControl:
    """What a hooked rank does with its control block: read mode/pause, answer benchmarks."""

    def __init__(self, ctl: np.ndarray) -> None:
        self._ctl = ctl

    @property
    def mode(self) -> ModeName:
        return mode_name(int(self._ctl["mode"]))

    def pause_requested(self) -> bool:
        return bool(self._ctl["pause_request"])

    def pause_target(self) -> tuple[int, int]:
        """(comm_id, seq) of a targeted pause; (0, 0) means the next call."""
        return int(self._ctl["pause_comm_id"]), int(self._ctl["pause_seq"])

    def set_paused(self, paused: bool, tid: int = 0) -> None:
        if paused:
            self._ctl["paused_tid"] = tid
            self._ctl["pause_count"] += 1
        self._ctl["paused"] = int(paused)

    def pending(self) -> list[tuple[int, BenchRequest]]:
        """Submitted requests, lowest id first (the order the hook runs them in)."""
        slots = self._ctl["slots"]
        out = []
        for i in np.flatnonzero(slots["state"] == BenchState.SUBMITTED):
            s = slots[int(i)]
            req = BenchRequest(kind=BenchKind(int(s["kind"])), size=int(s["size"]),
                               repeat=int(s["repeat"]), comm_id=int(s["comm_id"]),
                               peer=int(s["peer"]))
            out.append((int(s["req_id"]), req))
        return sorted(out, key=lambda t: t[0])

    def answer(self, req_id: int, state: BenchState, durations_ns: list[int],
               result: int = 0, drain_ns: int = 0) -> None:
        slots = self._ctl["slots"]
        hit = np.flatnonzero(slots["req_id"] == req_id)
        if hit.size == 0:
            raise KeyError(req_id)
        s = slots[int(hit[0])]
        n = min(len(durations_ns), s["durations_ns"].shape[0])
        s["durations_ns"][:n] = durations_ns[:n]
        s["n_done"] = n
        s["total_ns"] = int(sum(durations_ns[:n]))
        s["result"] = result
        s["drain_ns"] = drain_ns
        s["state"] = int(state)


def write_records(ring: RingMapping, records: np.ndarray) -> int:
    """Put RECORD_DTYPE rows into a mapped ring as the hook does: what does not fit is dropped
    and counted, and each slot's stamp is set only after its body, so a reader never takes a
    half-written record. Returns how many were written."""
    hdr = ring.hdr
    head = int(hdr["head"])
    free = ring.capacity - (head - int(hdr["consumed"]))
    keep = records[: max(free, 0)]
    if len(keep) < len(records):
        hdr["dropped"] += len(records) - len(keep)
    if len(keep) == 0:
        return 0
    idx = np.arange(head, head + len(keep), dtype=np.uint64)
    slots = (idx & np.uint64(ring.capacity - 1)).astype(np.int64)
    body = keep.copy()
    body["stamp"] = 0
    ring.records[slots] = body
    ring.records["stamp"][slots] = idx + np.uint64(1)
    hdr["head"] = head + len(keep)
    return len(keep)


@dataclass(frozen=True, slots=True)
class CommRow:
    """A communicator the rank belongs to, registered in the comm table at creation."""

    comm_id: int
    rank: int  # this rank's index in the communicator
    nranks: int
    peers: tuple[int, ...] = ()  # P2P peers (comm ranks), in the order the hook met them
    gpu_marks: bool = True  # the hook records GPU completion marks (False: host-only process)


class RingWriter:
    """One rank's ring file: created complete (an agent never sees it half-made), then records
    appended and comm rows overwritten.

    ``comms`` go into rows 0, 1, ... of the comm table in the order given. The clock anchors
    default to now; a simulation passes its own so that every rank shares one virtual clock.
    """

    def __init__(self, path: Path, *, job: str, rank: int, host: str, pid: int, device: int,
                 capacity: int, comms: Sequence[CommRow] = (), mono_anchor_ns: int | None = None,
                 wall_anchor_ns: int | None = None, gpu_api: GpuApi = GpuApi.UNKNOWN,
                 pci_bus_id: str = "") -> None:
        if capacity < 16 or capacity & (capacity - 1):
            raise ValueError("capacity must be a power of two >= 16")
        if len(comms) > MAX_COMMS:
            raise ValueError(f"{len(comms)} communicators: a ring holds at most {MAX_COMMS}")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        control_off = HEADER_BYTES
        comms_off = _page_up(control_off + CONTROL_DTYPE.itemsize)
        progress_off = _page_up(comms_off + MAX_COMMS * COMM_DTYPE.itemsize)
        records_off = _page_up(progress_off + PROGRESS_DTYPE.itemsize)
        size = records_off + capacity * RECORD_DTYPE.itemsize
        hdr = np.zeros((), HEADER_DTYPE)
        hdr["magic"] = MAGIC
        hdr["version"] = LAYOUT_VERSION
        hdr["header_bytes"] = HEADER_BYTES
        hdr["capacity"] = capacity
        hdr["record_bytes"] = RECORD_DTYPE.itemsize
        hdr["max_comms"] = MAX_COMMS
        hdr["max_peers"] = MAX_PEERS
        hdr["control_offset"] = control_off
        hdr["comms_offset"] = comms_off
        hdr["progress_offset"] = progress_off
        hdr["records_offset"] = records_off
        hdr["file_bytes"] = size
        hdr["job"] = job.encode()[:63]
        hdr["host"] = host.encode()[:63]
        hdr["rank"] = rank
        hdr["pid"] = pid
        hdr["device"] = device
        hdr["gpu_api"] = int(gpu_api)
        hdr["pci_bus_id"] = pci_bus_id.encode()[:19]
        hdr["mono_anchor_ns"] = time.monotonic_ns() if mono_anchor_ns is None else mono_anchor_ns
        hdr["wall_anchor_ns"] = time.time_ns() if wall_anchor_ns is None else wall_anchor_ns
        hdr["ready"] = 1
        tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
        with open(tmp, "wb") as f:
            f.truncate(size)
            f.write(hdr.tobytes())
        self._map = RingMapping(tmp)
        self._register(rank, comms)
        os.replace(tmp, path)  # only now may the agent see it: header and rows are final
        self._map.path = path
        self.nrows = len(comms)
        self._row_bytes = self._map.comm_table[: self.nrows].view(np.uint8)
        self.control = HookControl(self._map.ctl)
        self.capacity = self._map.capacity

    def _register(self, rank: int, comms: Sequence[CommRow]) -> None:
        for i, c in enumerate(comms):
            if len(c.peers) > MAX_PEERS:
                raise ValueError(f"communicator {c.comm_id}: at most {MAX_PEERS} peers")
            row = self._map.comm_table[i]
            row["comm_id"] = c.comm_id
            row["rank"] = c.rank
            row["nranks"] = c.nranks
            row["color"] = -1
            row["handle"] = _HANDLE_BASE + rank * 0x1000 + i * 0x10
            row["peer_ids"] = -1
            row["peer_ids"][: len(c.peers)] = c.peers
            row["npeers"] = len(c.peers)
            row["last_peer"] = -1
            row["gpu_pending_peer"] = -1
            row["gpu_marks"] = int(c.gpu_marks)
            row["state"] = int(CommState.ACTIVE)

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

    def append(self, records: np.ndarray) -> int:
        """Records in this rank's call order (stamps are set here); what does not fit is
        dropped and counted, like the hook does. Returns how many were written."""
        if records.dtype != RECORD_DTYPE:
            if records.dtype.names != RECORD_DTYPE.names:
                raise TypeError("records must have RECORD_DTYPE fields")
            records = records.astype(RECORD_DTYPE)  # e.g. np.concatenate drops the padding
        return write_records(self._map, records)

    def rows(self) -> np.ndarray:
        """A copy of the registered comm rows, in registration order."""
        out: np.ndarray = self._map.comm_table[: self.nrows].copy()
        return out

    def set_rows(self, rows: np.ndarray) -> None:
        """Overwrite the registered rows (the counters as the hook has moved them). Rows of the
        table's own dtype are copied as bytes into a view made once: a structured assignment
        into a fresh slice costs 9x more, and a 256-rank simulation sets every rank's rows at
        each of its steps."""
        if rows.dtype == COMM_DTYPE and rows.shape == (self.nrows,) and rows.flags.c_contiguous:
            np.copyto(self._row_bytes, rows.view(np.uint8))
        else:
            self._map.comm_table[: self.nrows] = rows

    def close(self) -> None:
        del self.control
        self._map.close()
