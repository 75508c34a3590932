"""The single Python mirror of the hook's shared-memory layout (native/include/greyhound_ring.h).

The node agent reads rings with `RingReader` and drives validation through `Control`; the
simulator plays ranks with `RingWriter`, which writes the exact bytes the C hook writes. Any change
here must match a GH_LAYOUT_VERSION bump in the C header; tests compare the two.
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass
from enum import IntEnum, IntFlag
from pathlib import Path
from typing import Any, Literal

import numpy as np

LAYOUT_VERSION = 3
MAGIC = 0x31474E4952484721
HEADER_BYTES = 4096
DEFAULT_RECORDS = 65536
MAX_COMMS = 64
MAX_PEERS = 64
BENCH_SLOTS = 16
BENCH_MAX_REPEAT = 64
NO_REDOP = 255


class Op(IntEnum):
    NONE = 0
    ALLREDUCE = 1
    ALLGATHER = 2
    REDUCESCATTER = 3
    BROADCAST = 4
    REDUCE = 5
    ALLTOALL = 6
    SEND = 7
    RECV = 8
    GROUP_START = 16
    GROUP_END = 17
    COMM_INIT = 32
    COMM_INIT_ALL = 33
    COMM_SPLIT = 34
    COMM_DESTROY = 35
    COMM_ABORT = 36
    ASYNC_ERROR = 37


class Flag(IntFlag):
    CAPTURED = 0x01
    ABORTED = 0x02
    IN_PROGRESS = 0x04
    PROFILED = 0x08
    GPU_DONE = 0x10
    IN_GROUP = 0x20
    GPU_LOST = 0x40


class CommState(IntEnum):
    FREE = 0
    ACTIVE = 1
    DESTROYED = 2
    ABORTED = 3


class BenchKind(IntEnum):
    SEND = 1
    RECV = 2
    GEMM = 3


class BenchState(IntEnum):
    EMPTY = 0
    SUBMITTED = 1
    RUNNING = 2
    DONE = 3
    UNSUPPORTED = 4
    FAILED = 5


COLLECTIVE_OPS = frozenset(
    {Op.ALLREDUCE, Op.ALLGATHER, Op.REDUCESCATTER, Op.BROADCAST, Op.REDUCE, Op.ALLTOALL}
)
P2P_OPS = frozenset({Op.SEND, Op.RECV})


def _struct(fields: list[tuple[str, Any, int]], itemsize: int) -> np.dtype[Any]:
    """A C struct as a numpy dtype with explicit offsets, so padding never drifts from the header."""
    return np.dtype(
        {
            "names": [f[0] for f in fields],
            "formats": [f[1] for f in fields],
            "offsets": [f[2] for f in fields],
            "itemsize": itemsize,
        }
    )


HEADER_DTYPE = _struct(
    [
        ("magic", "<u8", 0),
        ("version", "<u4", 8),
        ("header_bytes", "<u4", 12),
        ("capacity", "<u4", 16),
        ("record_bytes", "<u4", 20),
        ("max_comms", "<u4", 24),
        ("max_peers", "<u4", 28),
        ("control_offset", "<u8", 32),
        ("comms_offset", "<u8", 40),
        ("records_offset", "<u8", 48),
        ("file_bytes", "<u8", 56),
        ("job", "S64", 64),
        ("host", "S64", 128),
        ("rank", "<i4", 192),
        ("pid", "<i4", 196),
        ("device", "<i4", 200),
        ("ready", "<u4", 204),
        ("mono_anchor_ns", "<u8", 208),
        ("wall_anchor_ns", "<u8", 216),
        ("head", "<u8", 256),
        ("dropped", "<u8", 264),
        ("gpu_dropped", "<u8", 272),
        ("consumed", "<u8", 320),
    ],
    384,
)

RECORD_DTYPE = _struct(
    [
        ("stamp", "<u8", 0),
        ("comm_id", "<u8", 8),
        ("count", "<u8", 16),
        ("seq", "<u8", 24),
        ("enter_ns", "<u8", 32),
        ("return_ns", "<u8", 40),
        ("stream", "<u8", 48),
        ("group_id", "<u8", 56),
        ("gpu_start_ns", "<u8", 64),
        ("gpu_end_ns", "<u8", 72),
        ("comm_rank", "<i4", 80),
        ("nranks", "<i4", 84),
        ("peer", "<i4", 88),
        ("result", "<i4", 92),
        ("op", "<u2", 96),
        ("datatype", "u1", 98),
        ("redop", "u1", 99),
        ("flags", "<u4", 100),
        ("tid", "<u4", 104),
    ],
    128,
)

COMM_DTYPE = _struct(
    [
        ("comm_id", "<u8", 0),
        ("parent_id", "<u8", 8),
        ("state", "<u4", 16),
        ("rank", "<i4", 20),
        ("nranks", "<i4", 24),
        ("color", "<i4", 28),
        ("calls_entered", "<u8", 32),
        ("calls_completed", "<u8", 40),
        ("last_seq_entered", "<u8", 48),
        ("last_seq_completed", "<u8", 56),
        ("inflight_enter_ns", "<u8", 64),
        ("last_op", "<u4", 72),
        ("npeers", "<u4", 76),
        ("handle", "<u8", 80),
        ("splits", "<u8", 88),
        ("peer_ids", ("<i4", (MAX_PEERS,)), 96),
        ("send_count", ("<u8", (MAX_PEERS,)), 352),
        ("recv_count", ("<u8", (MAX_PEERS,)), 864),
        ("last_count", "<u8", 1376),
        ("last_dtype", "<u4", 1384),
        ("gpu_marks", "<u4", 1388),
        ("gpu_calls_done", "<u8", 1392),
        ("gpu_seq_done", "<u8", 1400),
        ("gpu_pending_ns", "<u8", 1408),
        ("gpu_pending_seq", "<u8", 1416),
        ("gpu_pending_op", "<u4", 1424),
        ("gpu_pending_dtype", "<u4", 1428),
        ("gpu_pending_count", "<u8", 1432),
        ("gpu_marks_lost", "<u8", 1440),
    ],
    1448,
)

BENCH_SLOT_DTYPE = _struct(
    [
        ("req_id", "<u8", 0),
        ("state", "<u4", 8),
        ("kind", "<u4", 12),
        ("comm_id", "<u8", 16),
        ("size", "<u8", 24),
        ("peer", "<i4", 32),
        ("repeat", "<i4", 36),
        ("result", "<i4", 40),
        ("n_done", "<u4", 44),
        ("total_ns", "<u8", 48),
        ("drain_ns", "<u8", 56),
        ("durations_ns", ("<u8", (BENCH_MAX_REPEAT,)), 64),
    ],
    576,
)

CONTROL_DTYPE = _struct(
    [
        ("mode", "<u4", 0),
        ("pause_request", "<u4", 4),
        ("paused", "<u4", 8),
        ("paused_tid", "<i4", 12),
        ("pause_count", "<u8", 16),
        ("pause_comm_id", "<u8", 24),
        ("pause_seq", "<u8", 32),
        ("slots", (BENCH_SLOT_DTYPE, (BENCH_SLOTS,)), 64),
    ],
    9280,
)

MODES: dict[str, int] = {"monitor": 0, "profile": 1}
_FINAL_BENCH = (BenchState.DONE, BenchState.UNSUPPORTED, BenchState.FAILED)
_GPU_PENDING = int(Flag.PROFILED)
_GPU_SETTLED = int(Flag.GPU_DONE | Flag.GPU_LOST | Flag.ABORTED)


def ring_path(shm_dir: Path, job: str, rank: int) -> Path:
    return Path(shm_dir) / job / f"rank-{rank}.ring"


def list_rings(shm_dir: Path, job: str | None = None) -> list[Path]:
    """Ring files sorted by (job, rank); temporaries of a rank still being created are skipped."""
    root = Path(shm_dir)
    jobs = [root / job] if job is not None else sorted(p for p in root.glob("*") if p.is_dir())
    found = [p for d in jobs for p in d.glob("rank-*.ring")]

    def key(p: Path) -> tuple[str, int]:
        return (p.parent.name, int(p.stem.split("-", 1)[1]))

    return sorted((p for p in found if p.stem.split("-", 1)[1].isdigit()), key=key)


@dataclass(frozen=True)
class RingHeader:
    version: int
    job: str
    rank: int
    host: str
    pid: int
    device: int
    capacity: int
    head: int
    dropped: int
    mono_anchor_ns: int
    wall_anchor_ns: int

    def to_wall_ns(self, mono_ns: int) -> int:
        return mono_ns - self.mono_anchor_ns + self.wall_anchor_ns


@dataclass(frozen=True)
class BenchRequest:
    kind: BenchKind
    size: int  # P2P: bytes; GEMM: matrix dimension N
    repeat: int = 1
    comm_id: int = 0
    peer: int = -1


@dataclass(frozen=True)
class BenchResult:
    req_id: int
    state: BenchState
    result: int  # ncclResult_t / cublasStatus_t of the first failure, 0 when fine
    durations_ns: tuple[int, ...]
    drain_ns: int = 0  # time the rank waited for its queued GPU work before measuring

    @property
    def ok(self) -> bool:
        return self.state == BenchState.DONE

    @property
    def unsupported(self) -> bool:
        return self.state == BenchState.UNSUPPORTED


class _Mapping:
    """A shared mapping of one ring file with numpy views of its regions."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise ValueError(f"{path}: {size} bytes is too small for a ring")
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.hdr = np.ndarray((), HEADER_DTYPE, buffer=self.mm, offset=0)
        if int(self.hdr["magic"]) != MAGIC:
            raise ValueError(f"{path}: not a Greyhound ring")
        if int(self.hdr["version"]) != LAYOUT_VERSION:
            raise ValueError(f"{path}: layout {int(self.hdr['version'])}, need {LAYOUT_VERSION}")
        cap = int(self.hdr["capacity"])
        if int(self.hdr["file_bytes"]) > size or cap & (cap - 1):
            raise ValueError(f"{path}: header does not match the file")
        self.capacity = cap
        self.ctl = np.ndarray(
            (), CONTROL_DTYPE, buffer=self.mm, offset=int(self.hdr["control_offset"])
        )
        self.comm_table = np.ndarray(
            (MAX_COMMS,), COMM_DTYPE, buffer=self.mm, offset=int(self.hdr["comms_offset"])
        )
        self.records = np.ndarray(
            (cap,), RECORD_DTYPE, buffer=self.mm, offset=int(self.hdr["records_offset"])
        )

    def header(self) -> RingHeader:
        h = self.hdr
        return RingHeader(
            version=int(h["version"]),
            job=bytes(h["job"].item()).decode(errors="replace"),
            rank=int(h["rank"]),
            host=bytes(h["host"].item()).decode(errors="replace"),
            pid=int(h["pid"]),
            device=int(h["device"]),
            capacity=int(h["capacity"]),
            head=int(h["head"]),
            dropped=int(h["dropped"]),
            mono_anchor_ns=int(h["mono_anchor_ns"]),
            wall_anchor_ns=int(h["wall_anchor_ns"]),
        )

    def slice_copy(self, start: int, n: int) -> np.ndarray:
        """Records [start, start + n) copied out of the ring, at most two slices (wrap)."""
        cap = self.capacity
        s = start & (cap - 1)
        if s + n <= cap:
            return self.records[s : s + n].copy()
        return np.concatenate((self.records[s:], self.records[: s + n - cap]))

    def close(self) -> None:
        for name in ("hdr", "ctl", "comm_table", "records"):
            self.__dict__.pop(name, None)
        self.mm.close()


class Control:
    """The agent's side of a rank's control block: mode, pause/resume and benchmark requests."""

    def __init__(self, path: Path) -> None:
        self._map = _Mapping(path)
        self._ctl = self._map.ctl
        slots = self._ctl["slots"]
        self._next_id = int(slots["req_id"].max()) + 1

    def set_mode(self, mode: Literal["monitor", "profile"]) -> None:
        self._ctl["mode"] = MODES[mode]

    def pause(self, comm_id: int = 0, seq: int = 0) -> None:
        """Park the training thread at its next NCCL call, or, with comm_id, at the entry of the
        call on that communicator whose collective seq would be >= seq. Pausing several ranks
        needs the targeted form with one (comm_id, seq) for all of them, seq beyond every rank's
        last_seq_entered (see comms()): a rank parked early would leave its peers blocked inside
        the collective it never entered."""
        self._ctl["pause_comm_id"] = comm_id
        self._ctl["pause_seq"] = seq
        self._ctl["pause_request"] = 1

    def paused(self) -> bool:
        return bool(self._ctl["paused"])

    def resume(self) -> None:
        self._ctl["pause_request"] = 0

    def submit(self, req: BenchRequest) -> int:
        if not 1 <= req.repeat <= BENCH_MAX_REPEAT:
            raise ValueError(f"repeat must be in 1..{BENCH_MAX_REPEAT}")
        slots = self._ctl["slots"]
        free = np.flatnonzero(slots["state"] == BenchState.EMPTY)
        if free.size == 0:
            raise RuntimeError("all benchmark slots are busy; collect results first")
        slot = slots[int(free[0])]
        req_id = self._next_id
        self._next_id += 1
        slot["kind"] = int(req.kind)
        slot["comm_id"] = req.comm_id
        slot["size"] = req.size
        slot["peer"] = req.peer
        slot["repeat"] = req.repeat
        slot["result"] = 0
        slot["n_done"] = 0
        slot["total_ns"] = 0
        slot["req_id"] = req_id
        slot["state"] = int(BenchState.SUBMITTED)  # last: the hook acts on this store
        return req_id

    def result(self, req_id: int) -> BenchResult | None:
        """The final result of a request (its slot is then freed), or None while pending."""
        slots = self._ctl["slots"]
        hit = np.flatnonzero(slots["req_id"] == req_id)
        if hit.size == 0:
            raise KeyError(req_id)
        slot = slots[int(hit[0])]
        state = BenchState(int(slot["state"]))
        if state not in _FINAL_BENCH:
            return None
        n = int(slot["n_done"])
        out = BenchResult(
            req_id=req_id,
            state=state,
            result=int(slot["result"]),
            durations_ns=tuple(int(d) for d in slot["durations_ns"][:n]),
            drain_ns=int(slot["drain_ns"]),
        )
        slot["state"] = int(BenchState.EMPTY)
        return out

    def close(self) -> None:
        del self._ctl
        self._map.close()


class RingReader:
    """The single consumer of one rank's ring.

    poll() hands out complete records in slot order and publishes the consumed cursor (which is
    what lets the hook reuse slots). A profiled record is held back until the poller has written
    its GPU times, or for at most gpu_wait_ns after its return, so callers see each record once
    and in final form. A slot reserved by a writer that never completed it (a killed thread) is
    skipped after stuck_ns and counted in `lost`, with the records the hook dropped.
    """

    def __init__(
        self, path: Path, *, gpu_wait_ns: int = 2_000_000_000, stuck_ns: int = 1_000_000_000
    ) -> None:
        self._map = _Mapping(path)
        self.header = self._map.header()
        self._cursor = int(self._map.hdr["consumed"])
        self._skipped = 0
        self._gpu_wait_ns = gpu_wait_ns
        self._stuck_ns = stuck_ns
        self._stuck_at: tuple[int, int] | None = None  # (cursor, first seen monotonic ns)

    @property
    def path(self) -> Path:
        return self._map.path

    @property
    def lost(self) -> int:
        return int(self._map.hdr["dropped"]) + self._skipped

    @property
    def cursor(self) -> int:
        return self._cursor

    def refresh_header(self) -> RingHeader:
        self.header = self._map.header()
        return self.header

    def poll(self, max_records: int | None = None) -> np.ndarray:
        head = int(self._map.hdr["head"])
        n = head - self._cursor
        if max_records is not None:
            n = min(n, max_records)
        if n <= 0:
            return np.empty(0, RECORD_DTYPE)
        batch = self._map.slice_copy(self._cursor, n)
        expect = np.arange(self._cursor + 1, self._cursor + n + 1, dtype=np.uint64)
        bad = batch["stamp"] != expect
        now = time.monotonic_ns()
        flags = batch["flags"]
        bad |= ((flags & _GPU_PENDING) != 0) & ((flags & _GPU_SETTLED) == 0) & (
            batch["return_ns"].astype(np.int64) > now - self._gpu_wait_ns
        )
        take = int(np.argmax(bad)) if bad.any() else n
        if take == 0 and batch["stamp"][0] != expect[0]:
            take = self._skip_if_stuck(now)
            batch = batch[:take]
        else:
            self._stuck_at = None
            batch = batch[:take]
        if take:
            self._cursor += take
            self._map.hdr["consumed"] = self._cursor
        return batch

    def _skip_if_stuck(self, now: int) -> int:
        if self._stuck_at is None or self._stuck_at[0] != self._cursor:
            self._stuck_at = (self._cursor, now)
            return 0
        if now - self._stuck_at[1] < self._stuck_ns:
            return 0
        self._skipped += 1
        self._cursor += 1
        self._map.hdr["consumed"] = self._cursor
        self._stuck_at = None
        return 0

    def comms(self) -> np.ndarray:
        table = self._map.comm_table
        rows: np.ndarray = table[table["state"] != CommState.FREE].copy()
        return rows

    def control(self) -> Control:
        return Control(self._map.path)

    def close(self) -> None:
        self._map.close()


# The writer lives in its own module (it is only the simulator's); it imports the names above.
from greyhound.hookabi_writer import HookControl, RingWriter  # noqa: E402

__all__ = [
    "COMM_DTYPE", "CONTROL_DTYPE", "HEADER_DTYPE", "LAYOUT_VERSION", "RECORD_DTYPE", "BenchKind",
    "BenchRequest", "BenchResult", "BenchState", "CommState", "Control", "Flag", "HookControl",
    "Op", "RingHeader", "RingReader", "RingWriter", "list_rings", "ring_path",
]
