"""The single Python mirror of the hook's shared-memory layout (native/include/greyhound_ring.h).

``layout`` holds the constants, enums and dtypes; ``reader`` the agent's side (RingReader,
Control); ``writer`` the hook's side (RingWriter, HookControl), which the simulator plays ranks
with. The names below are the public ones: ``from greyhound.hookabi import RingReader``.
"""

from greyhound.hookabi.layout import (
    BENCH_MAX_REPEAT,
    BENCH_SLOT_DTYPE,
    BENCH_SLOTS,
    COLLECTIVE_OPS,
    COMM_DTYPE,
    CONTROL_DTYPE,
    DEFAULT_RECORDS,
    HEADER_BYTES,
    HEADER_DTYPE,
    LAYOUT_VERSION,
    MAGIC,
    MAX_COMMS,
    MAX_PEERS,
    NO_REDOP,
    P2P_OP_NAMES,
    P2P_OPS,
    RECORD_DTYPE,
    BenchKind,
    BenchRequest,
    BenchResult,
    BenchState,
    CommState,
    Flag,
    Mode,
    ModeName,
    Op,
    RingHeader,
    list_rings,
    mode_name,
    op_name,
    ring_path,
    signed64,
    unsigned64,
)
from greyhound.hookabi.reader import Control, RingReader
from greyhound.hookabi.writer import CommRow, HookControl, RingWriter, write_records

__all__ = [
    "BENCH_MAX_REPEAT", "BENCH_SLOTS", "BENCH_SLOT_DTYPE", "COLLECTIVE_OPS", "COMM_DTYPE",
    "CONTROL_DTYPE", "DEFAULT_RECORDS", "HEADER_BYTES", "HEADER_DTYPE", "LAYOUT_VERSION", "MAGIC",
    "MAX_COMMS", "MAX_PEERS", "NO_REDOP", "P2P_OPS", "P2P_OP_NAMES", "RECORD_DTYPE", "BenchKind",
    "BenchRequest", "BenchResult", "BenchState", "CommRow", "CommState", "Control", "Flag",
    "HookControl", "Mode", "ModeName", "Op", "RingHeader", "RingReader", "RingWriter",
    "list_rings", "mode_name", "op_name", "ring_path", "signed64", "unsigned64", "write_records",
]
