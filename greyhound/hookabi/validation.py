"""What a ring file must satisfy before anything reads it by the offsets its header states.

A ring is written by the training process, which the agent does not trust: a corrupt, truncated,
foreign or hostile file must end as a :class:`RingError` naming what is wrong, never as a crash,
a multi-gigabyte allocation or a read outside the file. The header is checked field by field
against the layout (a hook built from another struct layout under the same version number shows
in ``record_bytes`` and ``max_peers``); comm-table rows and records are sanitised where the
agent turns them into bus messages. Pure: numpy in, values or a RingError out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    CommState,
)

# The hook's default is 2^16 records; GREYHOUND_RING_RECORDS may raise it, never near this (2^24
# records of 128 bytes is a 2 GiB ring). Anything larger is a corrupt header.
MAX_CAPACITY = 1 << 24
# Global ranks this far out are a corrupt header, not a job (the largest jobs are ~10^5 GPUs).
MAX_RANK = (1 << 24) - 1
# Counters and sequence numbers of a real rank stay far below 2^63: above, a row is nonsense.
_I64_MAX = np.uint64((1 << 63) - 1)
_COUNTER_FIELDS = ("calls_entered", "calls_completed", "last_seq_entered", "last_seq_completed",
                   "inflight_enter_ns", "last_count", "gpu_calls_done", "gpu_seq_done",
                   "gpu_pending_ns", "gpu_pending_seq", "gpu_pending_count")
_FIRST_LIVE, _LAST_LIVE = int(CommState.ACTIVE), int(CommState.INIT)  # DESTROYED, ABORTED between
_COUNTER_WORDS = np.array([COMM_DTYPE.fields[f][1] // 8 for f in _COUNTER_FIELDS])  # type: ignore[index]


class RingError(ValueError):
    """A ring file that does not satisfy the layout; ``reason`` is a short key for counting
    (``magic``, ``version``, ``header_bytes``, ``record_bytes``, ``comm_table``, ``capacity``,
    ``offsets``, ``truncated``, ``rank``, ``anchors``, ``not_a_file``, ``head``, ``closed``), the
    message says what was found."""

    def __init__(self, path: object, reason: str, detail: str) -> None:
        super().__init__(f"{path}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Geometry:
    """Where the regions of a checked ring lie (bytes from the start of the file)."""

    capacity: int
    control_offset: int
    comms_offset: int
    progress_offset: int
    records_offset: int
    file_bytes: int
    rank: int

    def record_offset(self, index: int) -> int:
        """File offset of the slot that record ``index`` (0-based, unwrapped) lives in."""
        return self.records_offset + (index & (self.capacity - 1)) * RECORD_DTYPE.itemsize


def _aligned(*values: int) -> bool:
    return all(v % 8 == 0 for v in values)


def check_header(hdr: np.ndarray[Any, Any], file_size: int, path: object = "ring") -> Geometry:
    """The geometry of a ring whose header ``hdr`` (a HEADER_DTYPE scalar) was read from a file
    of ``file_size`` bytes; RingError when any field is outside what the layout allows."""
    if hdr.dtype != HEADER_DTYPE:
        raise TypeError("hdr must be a HEADER_DTYPE value")
    if file_size < HEADER_BYTES:
        raise RingError(path, "truncated", f"{file_size} bytes is too small for a ring")
    if int(hdr["magic"]) != MAGIC:
        raise RingError(path, "magic", "not a Greyhound ring (bad magic)")
    version = int(hdr["version"])
    if version != LAYOUT_VERSION:
        raise RingError(path, "version", f"layout version {version}, this agent reads "
                                         f"{LAYOUT_VERSION}")
    sizes = {"header_bytes": (int(hdr["header_bytes"]), HEADER_BYTES),
             "record_bytes": (int(hdr["record_bytes"]), RECORD_DTYPE.itemsize)}
    for name, (got, want) in sizes.items():
        if got != want:
            raise RingError(path, name, f"{name} {got}, the layout has {want}: a hook built "
                                        "from another struct layout under the same version")
    # The header has no size field for a comm-table entry; its size follows from MAX_PEERS (the
    # peer arrays), so both counts must match the layout's, and the region must hold the table.
    comms = (int(hdr["max_comms"]), int(hdr["max_peers"]))
    if comms != (MAX_COMMS, MAX_PEERS):
        raise RingError(path, "comm_table", f"max_comms/max_peers {comms}, the layout has "
                                            f"{(MAX_COMMS, MAX_PEERS)}")
    cap = int(hdr["capacity"])
    if cap <= 0 or cap & (cap - 1) or cap > MAX_CAPACITY:
        raise RingError(path, "capacity", f"capacity {cap} is not a power of two in "
                                          f"1..{MAX_CAPACITY}")
    ctl, cm, prog, rec = (int(hdr["control_offset"]), int(hdr["comms_offset"]),
                          int(hdr["progress_offset"]), int(hdr["records_offset"]))
    file_bytes = int(hdr["file_bytes"])
    ends = (ctl + CONTROL_DTYPE.itemsize, cm + MAX_COMMS * COMM_DTYPE.itemsize,
            prog + PROGRESS_DTYPE.itemsize, rec + cap * RECORD_DTYPE.itemsize)
    if not (_aligned(ctl, cm, prog, rec) and ctl >= HEADER_BYTES and ends[0] <= cm
            and ends[1] <= prog and ends[2] <= rec and ends[3] <= file_bytes):
        raise RingError(path, "offsets", f"regions control@{ctl} comms@{cm} progress@{prog} "
                                         f"records@{rec} (x{cap}) do not fit in order in "
                                         f"{file_bytes} bytes")
    if file_bytes > file_size:
        raise RingError(path, "truncated", f"the header says {file_bytes} bytes, the file has "
                                           f"{file_size}")
    rank = int(hdr["rank"])
    if not 0 <= rank <= MAX_RANK:
        raise RingError(path, "rank", f"rank {rank} is outside 0..{MAX_RANK}")
    anchors = (int(hdr["mono_anchor_ns"]), int(hdr["wall_anchor_ns"]))
    if max(anchors) > _I64_MAX:
        raise RingError(path, "anchors", f"clock anchors {anchors} are beyond 2^63 ns")
    return Geometry(cap, ctl, cm, prog, rec, file_bytes, rank)


def sane_comm_rows(rows: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The comm-table rows that describe a communicator (COMM_DTYPE in, the sane ones out).

    A row in an unknown state, with a size or rank outside the communicator, or with a counter
    beyond 2^63 is left out: it can only come from a corrupt ring, and downstream every one of
    these numbers is a signed 64-bit value or an index. Called for every ring twice a second,
    so the counters are checked as one block of 64-bit words, not field by field."""
    rows = np.ascontiguousarray(rows)
    if rows.size == 0:
        return rows
    state = rows["state"]
    ok = (state >= _FIRST_LIVE) & (state <= _LAST_LIVE)
    nranks = rows["nranks"].astype(np.int64)
    ok &= (nranks >= 1) & (nranks <= MAX_RANK + 1)
    ok &= (rows["rank"] >= 0) & (rows["rank"].astype(np.int64) < nranks)
    words = rows.view(np.uint64).reshape(len(rows), -1)[:, _COUNTER_WORDS]
    ok &= (words <= _I64_MAX).all(axis=1)
    if ok.all():
        return rows
    kept: np.ndarray[Any, Any] = rows[ok]
    return kept


def sane_records(recs: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Records whose times and sizes can be real (RECORD_DTYPE in, the sane ones out): times and
    counts below 2^63, a return not before the entry, and a rank inside its communicator."""
    ok = recs["enter_ns"] <= _I64_MAX
    ok &= (recs["return_ns"] <= _I64_MAX) & (recs["return_ns"] >= recs["enter_ns"])
    ok &= (recs["count"] <= _I64_MAX) & (recs["seq"] <= _I64_MAX)
    ok &= (recs["gpu_start_ns"] <= _I64_MAX) & (recs["gpu_end_ns"] <= _I64_MAX)
    nranks = recs["nranks"]
    ok &= (nranks >= 0) & (nranks <= MAX_RANK + 1)
    ok &= (recs["comm_rank"] >= -1) & (recs["comm_rank"] < np.maximum(nranks, 1))
    ok &= (recs["peer"] >= -1) & (recs["peer"] <= MAX_RANK)
    if ok.all():
        return recs
    kept: np.ndarray[Any, Any] = recs[ok]
    return kept
