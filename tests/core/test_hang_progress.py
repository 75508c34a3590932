"""An H3 hang where every rank is stuck names, with progress counters, the rank that stopped first
instead of every rank; without them nothing changes."""

from __future__ import annotations

import numpy as np

from greyhound.core.hang_diagnosis import CommCounters, HangDiagnosis, LastRecords, diagnose_hang
from greyhound.core.hang_progress import refine_with_progress
from greyhound.core.progress import RECV, SEND, ProgressSample

S = 1_000_000_000
COMM = 42


def _all_stuck() -> list[HangDiagnosis]:
    """Four ranks entered collective #3 of COMM (seq 2) and none completed it."""
    n = 4
    counters = CommCounters(comm_id=[COMM] * n, rank=list(range(n)), entered=[3] * n,
                            completed=[2] * n)
    last = LastRecords(comm_id=[COMM] * n, rank=list(range(n)), seq=[2] * n, op=["allreduce"] * n,
                       count=[8] * n, dtype=[7] * n, enter_ns=[1.0 * S] * n, exit_ns=[-1.0] * n)
    return diagnose_hang(counters, last, now_ns=60 * S, stall_ns=10 * S)


def _ring_stopped_at(stopping: int, n: int = 4) -> ProgressSample:
    cols: dict[str, list[float]] = {f: [] for f in ProgressSample.__slots__}
    for r in range(n):
        d = (r - stopping) % n
        received = 6 + (n - 1 if d == 0 else d - 1)
        for kind, peer, done in ((SEND, (r + 1) % n, 6 + d), (RECV, (r - 1) % n, received)):
            row = dict(rank=r, comm_id=COMM, comm_rank=r, kind=kind, channel=0, peer=peer, posted=12,
                       done=done, bytes=0, net_s=0.0, stalled_s=30.0, seq=3, rate=0.0,
                       byte_rate=0.0, net_bw=0.0)
            for k, v in row.items():
                cols[k].append(v)
    return ProgressSample(**cols)


def test_every_rank_stuck_names_every_rank_without_progress() -> None:
    (d,) = _all_stuck()
    assert d.kind == "hang_hardware" and d.ranks == [0, 1, 2, 3] and d.evidence["localized"] == 0
    assert refine_with_progress([d], None, stall_s=5.0) == [d]


def test_progress_names_the_rank_that_stopped_first() -> None:
    (d,) = refine_with_progress(_all_stuck(), _ring_stopped_at(2), stall_s=5.0)
    assert d.kind == "hang_hardware" and d.ranks == [2]
    assert d.evidence["localized"] == 1 and d.evidence["localized_by"] == "progress"
    assert d.evidence["all_pending_ranks"] == [0, 1, 2, 3]
    links = d.evidence["inside_links"]
    assert isinstance(links, list) and len(links) == 1 and isinstance(links[0], dict)
    assert (links[0]["src"], links[0]["dst"], links[0]["channel"]) == (2, 3, 0)


def test_progress_still_moving_changes_nothing() -> None:
    s = _ring_stopped_at(2)
    moving = ProgressSample(**{**{f: getattr(s, f) for f in ProgressSample.__slots__},
                               "stalled_s": np.zeros(len(s))})
    (d,) = _all_stuck()
    assert refine_with_progress([d], moving, stall_s=5.0) == [d]
