"""From a tracker hang event to CCL-D's diagnosis: the adapter between the counter rows the agents
sampled and the pure ``diagnose_hang`` core."""

from __future__ import annotations

from typing import Any

import numpy as np

from greyhound.core.hang_diagnosis import CommCounters, HangDiagnosis, LastRecords, diagnose_hang
from greyhound.hookabi import Op

_U64 = 1 << 64


def signed64(v: int) -> int:
    """Communicator ids are unsigned 64-bit hashes; the numpy cores work in int64."""
    return v - _U64 if v >= 1 << 63 else v


def unsigned64(v: int) -> int:
    return v + _U64 if v < 0 else v


def op_name(code: int) -> str:
    try:
        return Op(code).name.lower()
    except ValueError:
        return f"op{code}"


def diagnose_from_rows(rows: dict[str, list[Any]], *, now_ns: int,
                       stalled_s: float) -> list[HangDiagnosis]:
    """``rows``: one communicator's latest counter rows (columnar, COUNTER_FIELDS)."""
    n = len(rows.get("rank", []))
    if n == 0:
        return []
    comm = np.array([signed64(int(c)) for c in rows["comm_id"]], dtype=np.int64)
    inflight = np.asarray(rows["inflight_s"], dtype=np.float64)
    entered = np.asarray(rows["last_seq_entered"], dtype=np.int64)
    completed = np.asarray(rows["last_seq_completed"], dtype=np.int64)
    quiet_since = now_ns - stalled_s * 1e9
    enter_ns = np.where(inflight > 0, now_ns - inflight * 1e9, quiet_since)
    exit_ns = np.where(inflight > 0, -1.0, quiet_since)
    # a send/receive moves the call counters but no collective sequence number
    in_call = (np.asarray(rows["entered"], dtype=np.int64)
               > np.asarray(rows["completed"], dtype=np.int64)) | (inflight > 0)
    counters = CommCounters(comm_id=comm, rank=np.asarray(rows["rank"]), entered=entered,
                            completed=completed, in_call=in_call)
    last = LastRecords(
        comm_id=comm, rank=np.asarray(rows["rank"]), seq=entered - 1,
        op=np.array([op_name(int(o)) for o in rows["last_op"]]),
        count=np.asarray(rows["last_count"]), dtype=np.asarray(rows["last_dtype"]),
        enter_ns=enter_ns, exit_ns=exit_ns)
    stall_ns = max(1, int(stalled_s * 1e9 * 0.5))
    return diagnose_hang(counters, last, now_ns=now_ns, stall_ns=stall_ns)
