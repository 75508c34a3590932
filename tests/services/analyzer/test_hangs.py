"""The analyzer's hang adapter: counter rows of a tracker hang event to a CCL-D diagnosis, on the
GPU timeline where the rows carry completion marks and on host time where they do not."""

from __future__ import annotations

from typing import Any

from greyhound.core.job_hangs import COUNTER_FIELDS
from greyhound.hookabi import Op
from services.analyzer.hangs import diagnose_from_rows
from services.analyzer.service import Analyzer
from services.common.bus.contract import DetectionEvent

COMM = (1 << 64) - 99  # an unsigned hash above 2^63
NOW = 1_700_000_000_000_000_000


def _past_the_hung_call(odd_op: int = Op.ALLGATHER) -> dict[str, list[Any]]:
    """Four ranks stuck at collective 10 on the GPU for 40 s; rank 3 enqueued a different op
    there. Every host has returned from every call and enqueued 11 and 12 before blocking in
    its synchronisation: the hosts' newest calls agree."""
    n = 4
    rows: dict[str, list[Any]] = {f: [0] * n for f in COUNTER_FIELDS}
    rows.update(
        rank=list(range(n)), comm_id=[COMM] * n, comm_rank=list(range(n)), nranks=[n] * n,
        entered=[12] * n, completed=[12] * n, last_seq_entered=[12] * n,
        last_seq_completed=[12] * n, inflight_s=[0.0] * n, last_op=[int(Op.ALLREDUCE)] * n,
        last_count=[1 << 20] * n, last_dtype=[7] * n, gpu_marks=[1] * n, gpu_completed=[9] * n,
        gpu_seq_completed=[9] * n, gpu_pending_s=[40.0] * n, gpu_pending_seq=[10] * n,
        gpu_pending_op=[int(Op.ALLREDUCE)] * 3 + [int(odd_op)], gpu_pending_count=[1 << 20] * n,
        gpu_pending_dtype=[7] * n)
    return rows


def test_inconsistent_found_while_the_hosts_moved_past_the_hung_sequence() -> None:
    (d,) = diagnose_from_rows(_past_the_hung_call(), now_ns=NOW, stalled_s=40.0)
    assert d.kind == "hang_inconsistent" and d.ranks == [3] and d.op == "allreduce"
    assert d.seq == 9  # 0-based: the 10th collective, where the GPUs are, not the hosts' 12th
    assert d.evidence["their_ops"] == ["allgather"] and d.evidence["basis"] == "gpu"


def test_same_pending_call_everywhere_is_hardware() -> None:
    (d,) = diagnose_from_rows(_past_the_hung_call(odd_op=Op.ALLREDUCE), now_ns=NOW,
                              stalled_s=40.0)
    assert d.kind == "hang_hardware" and d.ranks == [0, 1, 2, 3] and d.evidence["localized"] == 0


def test_rows_from_before_gpu_marks_are_read_on_host_time() -> None:
    """A stored event whose rows have no GPU columns: rank 2 never entered, its peers are
    inside the collective on the host."""
    n = 4
    rows: dict[str, list[Any]] = {
        "rank": list(range(n)), "comm_id": [COMM] * n, "comm_rank": list(range(n)),
        "nranks": [n] * n, "entered": [10, 10, 9, 10], "completed": [9] * n,
        "last_seq_entered": [10, 10, 9, 10], "last_seq_completed": [9] * n,
        "inflight_s": [30.0, 30.0, 0.0, 30.0], "last_op": [int(Op.ALLREDUCE)] * n,
        "last_count": [8] * n, "last_dtype": [7] * n}
    (d,) = diagnose_from_rows(rows, now_ns=NOW, stalled_s=30.0)
    assert d.kind == "hang_not_entered" and d.ranks == [2] and d.evidence["basis"] == "host"


def test_hang_event_becomes_a_named_incident() -> None:
    det = DetectionEvent(job_id="j", kind="hang", ranks=[0, 1, 2, 3], first_iteration=-1,
                         detected_iteration=-1, before_s=0.5, after_s=40.0, detected_ns=NOW,
                         comm_id=COMM, stalled_s=40.0, threshold_s=20.0, method="hang-watch",
                         evidence={"counters": _past_the_hung_call(), "wait_basis": "gpu"})
    kind, severity, culprit, summary = Analyzer._classify(det)
    assert kind == "hang_inconsistent" and culprit.ranks == [3] and severity == 2.0
    assert culprit.comm_id == COMM and "allreduce #9" in summary
