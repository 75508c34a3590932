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


def _all_pending() -> dict[str, list[Any]]:
    """Four ranks entered collective 10 and none finished it on the GPU: the comm table names all."""
    rows = _past_the_hung_call(odd_op=Op.ALLREDUCE)
    rows.update(last_seq_entered=[10] * 4, entered=[10] * 4, completed=[10] * 4,
                last_seq_completed=[10] * 4)
    return rows


def _ring_progress(stopping: int) -> dict[str, list[Any]]:
    """The plugin's rows of a ring channel where ``stopping`` stopped sending first."""
    cols: dict[str, list[Any]] = {}
    for r in range(4):
        d = (r - stopping) % 4
        for kind, peer, done in ((0, (r + 1) % 4, 6 + d), (1, (r - 1) % 4, 6 + (3 if d == 0 else d - 1))):
            row = dict(rank=r, comm_id=COMM, comm_rank=r, kind=kind, channel=1, peer=peer,
                       posted=12, done=done, bytes=done * 100, net_s=0.1, stalled_s=35.0, seq=10,
                       rate=0.0, byte_rate=0.0, net_bw=0.0)
            for k, v in row.items():
                cols.setdefault(k, []).append(v)
    return cols


def test_a_hang_where_every_rank_is_stuck_names_who_stopped_first_from_the_plugins_rows() -> None:
    ev: dict[str, Any] = {"counters": _all_pending(), "wait_basis": "gpu"}
    det = DetectionEvent(job_id="j", kind="hang", ranks=[0, 1, 2, 3], first_iteration=-1,
                         detected_iteration=-1, before_s=0.5, after_s=40.0, detected_ns=NOW,
                         comm_id=COMM, stalled_s=40.0, threshold_s=20.0, method="hang-watch",
                         evidence=ev)
    kind, _, culprit, _ = Analyzer._classify(det)
    assert kind == "hang_hardware" and culprit.ranks == [0, 1, 2, 3]
    det = det.model_copy(update={"evidence": {**ev, "progress": _ring_progress(1)}})
    kind, _, culprit, summary = Analyzer._classify(det)
    assert kind == "hang_hardware" and culprit.ranks == [1] and "ranks [1]" in summary
    assert culprit.diagnosis is not None
    links = culprit.diagnosis["inside_links"]
    assert isinstance(links, list) and len(links) == 1 and isinstance(links[0], dict)
    link = links[0]
    assert (link["src"], link["dst"], link["channel"], link["stopped"]) == (1, 2, 1, "sender")


def test_a_slowdown_names_the_slow_link_the_plugins_rates_found() -> None:
    link = {"comm_id": 5, "src": 2, "dst": 3, "src_rank": 2, "dst_rank": 3, "channels": [0, 1],
            "bandwidth_Bps": 2.5e8, "others_Bps": 1e9, "ratio": 0.25}
    det = DetectionEvent(job_id="j", kind="slowdown", ranks=[], first_iteration=10,
                         detected_iteration=14, before_s=0.1, after_s=0.3, detected_ns=NOW,
                         method="bocd", evidence={"change": "onset", "slow_links": [link]})
    kind, _, culprit, _ = Analyzer._classify(det)
    assert kind == "slowdown" and culprit.slow_links == [link]
    kind, _, culprit, _ = Analyzer._classify(det.model_copy(update={"evidence": {"change": "onset"}}))
    assert culprit.slow_links == []


def test_a_pipeline_pair_that_disagrees_on_the_size_is_named_by_the_pair() -> None:
    """Stage 0 sends 1 Mi floats to stage 1, which posted a receive of one more: both pending on
    the GPU. The comm table's pending peers name the pair and its sizes (layout 6)."""
    n = 2
    rows: dict[str, list[Any]] = {f: [0] * n for f in COUNTER_FIELDS}
    rows.update(rank=[4, 12], comm_id=[COMM] * n, comm_rank=[0, 1], nranks=[n] * n,
                entered=[7, 7], completed=[7, 7], last_op=[int(Op.SEND), int(Op.RECV)],
                gpu_marks=[1] * n, gpu_completed=[6] * n, gpu_pending_s=[40.0] * n,
                gpu_pending_op=[int(Op.SEND), int(Op.RECV)], gpu_pending_count=[1 << 20, (1 << 20) + 1],
                gpu_pending_dtype=[7] * n, gpu_pending_peer=[1, 0], last_peer=[1, 0])
    (d,) = diagnose_from_rows(rows, now_ns=NOW, stalled_s=40.0)
    assert d.kind == "hang_inconsistent" and d.ranks == [4, 12]
    assert (d.evidence["send_count"], d.evidence["recv_count"]) == (1 << 20, (1 << 20) + 1)
    rows["gpu_pending_peer"] = []  # an older agent: no peers, the pair cannot be checked
    assert all(d.kind != "hang_inconsistent" for d in diagnose_from_rows(rows, now_ns=NOW, stalled_s=40.0))
