"""The hook's shared-memory layout in Python: constants, enums and numpy dtypes of
native/include/greyhound_ring.h, and the value types read from and written to a ring.

Nothing here touches a file. Any change must match a GH_LAYOUT_VERSION bump in the C header;
tests/hookabi compares offsets, sizes, enum values and constants with the header itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum, IntFlag
from pathlib import Path
from typing import Any, Literal

import numpy as np

LAYOUT_VERSION = 6
MAGIC = 0x31474E4952484721
HEADER_BYTES = 4096
DEFAULT_RECORDS = 65536
MAX_COMMS = 64
MAX_PEERS = 64
BENCH_SLOTS = 16
BENCH_MAX_REPEAT = 64
BENCH_MAX_GEMM_N = 16384  # a GEMM of N takes 3 N^2 floats of scratch on the rank's GPU
BENCH_MAX_P2P_BYTES = 1 << 30
PAUSE_LEASE_DEFAULT_MS = 30_000  # the hook's lease for a pause requested without one
PAUSE_LEASE_MAX_MS = 600_000  # a deadline further out is brought in to this
PAUSE_TIMEOUT_SHARE = 4  # a pause lasts at most this share of the job's collective timeout
BENCH_MAX_COMMS = 16  # benchmark communicators alive at once on one rank
NO_REDOP = 255
PROG_SLOTS = 64  # (communicator, channel, peer, direction) network transfer counters per rank
KCH_SLOTS = 32  # (communicator, channel) kernel slots per rank
PROG_CLASSES = 16  # profiler event classes counted (bit i of NCCL's activation mask)


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
    COMM_SHRINK = 38


class Flag(IntFlag):
    CAPTURED = 0x01
    ABORTED = 0x02
    IN_PROGRESS = 0x04
    PROFILED = 0x08
    GPU_DONE = 0x10
    IN_GROUP = 0x20
    GPU_LOST = 0x40


class Mode(IntEnum):
    """What the hook records: counters only, or every call with its GPU times."""

    MONITOR = 0
    PROFILE = 1


ModeName = Literal["monitor", "profile"]


def mode_name(value: int) -> ModeName:
    """The name the bus and the agent use for a control block's mode word."""
    return "profile" if value == Mode.PROFILE else "monitor"


class CommState(IntEnum):
    FREE = 0
    ACTIVE = 1
    DESTROYED = 2
    ABORTED = 3
    INIT = 4  # being created: its ranks are inside ncclCommInitRank* (a wait there is in flight)


class GpuApi(IntEnum):
    """What a rank's GPU completion marks and profile times rest on (header ``gpu_api``)."""

    UNKNOWN = 0  # not decided yet (no communicator so far)
    RUNTIME = 1  # the process's shared CUDA runtime
    DRIVER = 2  # the CUDA driver API (a statically linked runtime, or a driver-API program)
    NONE = 3  # no CUDA in the process: no marks, host times only


class ProgDir(IntEnum):
    """A progress slot's direction (``key >> 16``)."""

    SEND = 0
    RECV = 1


class StepState(IntEnum):
    """The last state of a progress slot's newest network step (NCCL's ProxyStep states)."""

    NONE = 0
    POSTED = 1  # started, no state yet (or only its op is counted: ProxyStep events off)
    SEND_GPU_WAIT = 2  # waiting for this rank's GPU to fill the buffer
    SEND_PEER_WAIT = 3  # waiting for the receiver's credit
    SEND_WAIT = 4  # on the network, waiting for completion
    RECV_WAIT = 5  # waiting for the peer's data
    RECV_FLUSH_WAIT = 6
    RECV_GPU_WAIT = 7  # received, waiting for this rank's GPU to take it
    DONE = 8


class ProfileClass(IntFlag):
    """NCCL's profiler event classes, as bits of its activation mask (``events[i]`` counts bit i)."""

    GROUP = 1 << 0
    COLL = 1 << 1
    P2P = 1 << 2
    PROXY_OP = 1 << 3
    PROXY_STEP = 1 << 4
    PROXY_CTRL = 1 << 5
    KERNEL_CH = 1 << 6
    NET_PLUGIN = 1 << 7
    GROUP_API = 1 << 8
    COLL_API = 1 << 9
    P2P_API = 1 << 10
    KERNEL_LAUNCH = 1 << 11
    CE_COLL = 1 << 12
    CE_SYNC = 1 << 13
    CE_BATCH = 1 << 14


# Lifecycle calls: while one is inside NCCL on a communicator (``life_op``), the agent reports
# it as the row's last op, and the hang watch gives it the set-up allowance.
LIFECYCLE_OPS: tuple[Op, ...] = (
    Op.COMM_INIT, Op.COMM_INIT_ALL, Op.COMM_SPLIT, Op.COMM_DESTROY, Op.COMM_ABORT, Op.COMM_SHRINK)


class BenchKind(IntEnum):
    """SEND and RECV run on the benchmark communicator SPLIT made from their comm_id, never on
    the job's own; DRAIN only waits for the rank's queued GPU work."""

    SEND = 1
    RECV = 2
    GEMM = 3
    DRAIN = 4
    SPLIT = 5


class BenchState(IntEnum):
    EMPTY = 0
    SUBMITTED = 1
    RUNNING = 2
    DONE = 3
    UNSUPPORTED = 4
    FAILED = 5


# Tuples, not sets: numpy's isin takes them as they are (a set would be one object).
COLLECTIVE_OPS: tuple[Op, ...] = (
    Op.ALLREDUCE, Op.ALLGATHER, Op.REDUCESCATTER, Op.BROADCAST, Op.REDUCE, Op.ALLTOALL)
P2P_OPS: tuple[Op, ...] = (Op.SEND, Op.RECV)
P2P_OP_NAMES: tuple[str, ...] = tuple(op.name.lower() for op in P2P_OPS)  # as op_name() spells them

_U64 = 1 << 64


def op_name(code: int) -> str:
    """An op code as the cores and the incidents spell it (``allreduce``, ``send``)."""
    try:
        return Op(code).name.lower()
    except ValueError:
        return f"op{code}"


def unsigned64(v: int) -> int:
    """Communicator ids are unsigned 64-bit hashes in the rings; some paths carry them signed."""
    return v % _U64


def signed64(v: int) -> int:
    """The same id as int64, the type the numpy cores index with."""
    v %= _U64
    return v - _U64 if v >= 1 << 63 else v


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
        ("gpu_api", "<u4", 224),
        ("pci_bus_id", "S20", 228),
        ("progress_offset", "<u8", 248),
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
        ("host_ver", "<u4", 1448),
        ("gpu_ver", "<u4", 1452),
        ("life_op", "<u4", 1456),
        ("life_ver", "<u4", 1460),
        ("last_peer", "<i4", 1464),
        ("gpu_pending_peer", "<i4", 1468),
    ],
    1472,
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
        ("pause_lease_ns", "<u8", 40),
        ("lease_expired", "<u8", 48),
        ("job_timeout_ms", "<u4", 56),
        ("pause_cap_ms", "<u4", 60),
        ("slots", (BENCH_SLOT_DTYPE, (BENCH_SLOTS,)), 64),
        ("pause_shortened", "<u8", 9280),
        ("bench_comms_made", "<u8", 9288),
        ("bench_comms_aborted", "<u8", 9296),
    ],
    9344,
)

PROG_SLOT_DTYPE = _struct(
    [
        ("key", "<u4", 0),
        ("peer", "<i4", 4),
        ("steps_posted", "<u8", 8),
        ("steps_done", "<u8", 16),
        ("bytes", "<u8", 24),
        ("net_ns", "<u8", 32),
        ("last_ns", "<u8", 40),
        ("seq", "<u8", 48),
        ("ops_posted", "<u2", 56),
        ("ops_done", "<u2", 58),
        ("op", "u1", 60),
        ("state", "u1", 61),
        ("pad", "<u2", 62),
    ],
    64,
)

KCH_SLOT_DTYPE = _struct(
    [
        ("key", "<u4", 0),
        ("starts", "<u4", 4),
        ("stops", "<u4", 8),
        ("pad", "<u4", 12),
        ("start_ptimer", "<u8", 16),
        ("stop_ptimer", "<u8", 24),
        ("last_ns", "<u8", 32),
    ],
    40,
)

PROGRESS_DTYPE = _struct(
    [
        ("plugin_version", "<u4", 0),
        ("mask_applied", "<u4", 4),
        ("mask_extra", "<u4", 8),
        ("contexts", "<u4", 12),
        ("dropped", "<u8", 16),
        ("unbound", "<u8", 24),
        ("events", ("<u8", (PROG_CLASSES,)), 32),
        ("slots", (PROG_SLOT_DTYPE, (PROG_SLOTS,)), 160),
        ("kch", (KCH_SLOT_DTYPE, (KCH_SLOTS,)), 4256),
    ],
    5536,
)

FINAL_BENCH_STATES = frozenset({BenchState.DONE, BenchState.UNSUPPORTED, BenchState.FAILED})


def ring_path(shm_dir: Path, job: str, rank: int) -> Path:
    return Path(shm_dir) / job / f"rank-{rank}.ring"


def ring_names(names: Iterable[str]) -> list[str]:
    """The ring files among a job directory's entries, by rank (temporaries of a rank still
    being created are left out)."""
    rings = [n for n in names if n.startswith("rank-") and n.endswith(".ring")
             and n[5:-5].isdigit()]
    return sorted(rings, key=lambda n: int(n[5:-5]))


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
    gpu_api: GpuApi = GpuApi.UNKNOWN
    pci_bus_id: str = ""  # the device's PCI bus id as CUDA names it, "" unknown

    @property
    def marks_off(self) -> bool:
        """True when the hook found no CUDA in the process: no GPU completion marks or times."""
        return self.gpu_api == GpuApi.NONE

    def to_wall_ns(self, mono_ns: int) -> int:
        return mono_ns - self.mono_anchor_ns + self.wall_anchor_ns


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark for a parked rank. Sizes are checked here, where requests are built, as the
    hook checks them again: a GEMM's 3 N^2 floats must not overflow nor take the GPU's memory."""

    kind: BenchKind
    size: int  # P2P: bytes; GEMM: matrix dimension N
    repeat: int = 1
    comm_id: int = 0
    peer: int = -1

    def __post_init__(self) -> None:
        if self.kind == BenchKind.GEMM and not 1 <= self.size <= BENCH_MAX_GEMM_N:
            raise ValueError(f"GEMM dimension {self.size} is outside 1..{BENCH_MAX_GEMM_N}")
        if self.kind != BenchKind.GEMM and not 0 <= self.size <= BENCH_MAX_P2P_BYTES:
            raise ValueError(f"transfer of {self.size} bytes is outside 0..{BENCH_MAX_P2P_BYTES}")


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
