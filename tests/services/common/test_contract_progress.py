"""The profiler plugin's rows on the bus: an optional part of a CounterBatch, with the two peer
columns of layout 6 optional too, so that batches from older agents still decode."""

from __future__ import annotations

import time
from typing import Any

import pytest
from pydantic import ValidationError

from services.common.bus.contract import CounterBatch, ProgressRows, split_columns


def _counters(n: int, **extra: Any) -> dict[str, Any]:
    cols: dict[str, Any] = {c: [0] * n for c in CounterBatch.COLUMNS if c not in CounterBatch.OPTIONAL}
    cols.update(rank=list(range(n)), comm_id=[9] * n, nranks=[n] * n, **extra)
    return {"job_id": "j", "agent_id": "a", "sampled_ns": time.time_ns(), **cols}


def _progress(n: int) -> dict[str, list[Any]]:
    cols: dict[str, list[Any]] = {c: [0] * n for c in ProgressRows.COLUMNS}
    cols.update(rank=list(range(n)), comm_id=[9] * n, peer=[-1] * n, kind=[2] * n,
                net_bw=[1.5e9] * n)
    return cols


def test_a_batch_from_an_older_agent_decodes_without_peers_or_progress() -> None:
    b = CounterBatch.model_validate(_counters(3))
    assert b.last_peer == [] and b.gpu_pending_peer == [] and b.progress is None


def test_peer_columns_when_sent_have_every_row() -> None:
    b = CounterBatch.model_validate(_counters(2, last_peer=[1, -1], gpu_pending_peer=[-1, 0]))
    assert b.gpu_pending_peer == [-1, 0]
    with pytest.raises(ValidationError):
        CounterBatch.model_validate(_counters(2, last_peer=[1]))


def test_progress_rows_are_bounded_and_travel_once_when_a_batch_is_split() -> None:
    b = CounterBatch.model_validate({**_counters(4), "progress": _progress(3)})
    assert b.progress is not None and b.progress.net_bw == [1.5e9] * 3
    lo, hi = split_columns(b)  # type: ignore[misc]
    assert isinstance(lo, CounterBatch) and isinstance(hi, CounterBatch)
    assert lo.progress == b.progress and hi.progress is None
    for bad in ({"kind": [3, 0, 0]}, {"net_bw": [float("inf")] * 3}, {"stalled_s": [-1.0] * 3},
                {"rank": [0, 1]}):
        with pytest.raises(ValidationError):
            ProgressRows.model_validate({**_progress(3), **bad})
