"""From a tracker hang event to CCL-D's diagnosis: the adapter between the counter rows the agents
sampled and the pure cores (``diagnosis_inputs`` reads them on the GPU timeline where the hook
recorded completion marks, ``diagnose_hang`` names the cause, ``p2p_pair_hangs`` names pipeline
hangs by their pair, ``refine_with_progress`` looks inside the collective with the profiler
plugin's counters)."""

from __future__ import annotations

from typing import Any

import numpy as np

from greyhound.core.hang_counters import SampledCounters, diagnosis_inputs
from greyhound.core.hang_diagnosis import HangDiagnosis, diagnose_hang
from greyhound.core.hang_progress import refine_with_progress
from greyhound.core.p2p_hangs import PendingP2p, merge_pair_hangs, p2p_pair_hangs
from greyhound.core.progress import ProgressSample
from greyhound.hookabi import op_name, signed64


def diagnose_from_rows(rows: dict[str, list[Any]], *, now_ns: int, stalled_s: float,
                       progress: dict[str, list[Any]] | None = None) -> list[HangDiagnosis]:
    """``rows``: the latest counter rows of the stalled communicators and their members' others
    (columnar, COUNTER_FIELDS). Rows from before GPU completion marks existed have no GPU
    columns: they are read as host-only rows. Each diagnosis's evidence says which basis its
    rows had."""
    n = len(rows.get("rank", []))
    if n == 0:
        return []

    def col(name: str, default: int = 0) -> np.ndarray:
        values = rows.get(name, [])
        return np.asarray(values if len(values) == n else [default] * n)

    sample = SampledCounters(
        comm_id=np.array([signed64(int(c)) for c in rows["comm_id"]], dtype=np.int64),
        rank=col("rank"), calls_entered=col("entered"), calls_completed=col("completed"),
        seq_entered=col("last_seq_entered"), seq_completed=col("last_seq_completed"),
        inflight_s=col("inflight_s"), last_op=_op_names(col("last_op")),
        last_count=col("last_count"), last_dtype=col("last_dtype"),
        gpu_marks=col("gpu_marks") != 0, gpu_seq_completed=col("gpu_seq_completed"),
        gpu_pending_s=col("gpu_pending_s"), gpu_pending_seq=col("gpu_pending_seq"),
        gpu_pending_op=_op_names(col("gpu_pending_op")),
        gpu_pending_count=col("gpu_pending_count"), gpu_pending_dtype=col("gpu_pending_dtype"))
    counters, last = diagnosis_inputs(sample, now_ns=now_ns, stalled_s=stalled_s)
    stall_ns = max(1, int(stalled_s * 1e9 * 0.5))
    found = diagnose_hang(counters, last, now_ns=now_ns, stall_ns=stall_ns)
    pending = PendingP2p(comm_id=sample.comm_id, rank=sample.rank, comm_rank=col("comm_rank", -1),
                         op=sample.gpu_pending_op, peer=col("gpu_pending_peer", -1),
                         count=sample.gpu_pending_count, pending_s=sample.gpu_pending_s)
    found = merge_pair_hangs(found, p2p_pair_hangs(pending, stall_s=stall_ns / 1e9))
    found = refine_with_progress(found, _progress(progress), stall_s=stall_ns / 1e9)
    basis = sample.basis()
    for d in found:
        d.evidence["basis"] = basis
    return found


def _progress(cols: dict[str, list[Any]] | None) -> ProgressSample | None:
    """The plugin's rows, communicators named as the diagnoses name them (int64)."""
    if not cols or not cols.get("rank"):
        return None
    data = dict(cols)
    data["comm_id"] = [signed64(int(c)) for c in cols["comm_id"]]
    return ProgressSample.from_columns(data)


def _op_names(op_codes: np.ndarray) -> np.ndarray:
    names = {int(o): op_name(int(o)) for o in np.unique(op_codes)}
    return np.array([names[int(o)] for o in op_codes.tolist()], dtype=str)


__all__ = ["diagnose_from_rows"]
