"""A slowdown detection carries the links the profiler plugin's latest rates name slow: the
tracker keeps every communicator's newest rows from the agents' counter batches."""

from __future__ import annotations

from typing import Any

from greyhound.core.job_hangs import COUNTER_FIELDS, PROGRESS_FIELDS, JobHangMonitor
from services.tracker.service import _slow_links


def _batch(bandwidth: list[float]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """Four ranks of one communicator (a ring), each sending to the next at ``bandwidth``."""
    n = len(bandwidth)
    counters: dict[str, list[Any]] = {f: [0] * n for f in COUNTER_FIELDS}
    counters.update(rank=list(range(n)), comm_id=[7] * n, comm_rank=list(range(n)), nranks=[n] * n)
    prog: dict[str, list[Any]] = {f: [0] * n for f in PROGRESS_FIELDS}
    prog.update(rank=list(range(n)), comm_id=[7] * n, comm_rank=list(range(n)), kind=[0] * n,
                peer=[(r + 1) % n for r in range(n)], net_bw=bandwidth, net_s=[0.1] * n,
                stalled_s=[0.0] * n, rate=[0.0] * n, byte_rate=[0.0] * n)
    return counters, prog


def test_the_newest_rows_name_the_slow_link_and_replace_older_ones() -> None:
    mon = JobHangMonitor()
    mon.observe_counters(1.0, *_batch([1e9, 1e9, 2e8, 1e9]))
    (link,) = _slow_links(mon)
    assert (link["src_rank"], link["dst_rank"]) == (2, 3) and link["ratio"] < 0.5
    mon.observe_counters(2.0, *_batch([1e9] * 4))  # the link recovered
    assert _slow_links(mon) == []
    mon.observe_counters(3.0, _batch([1e9] * 4)[0])  # a batch with no plugin rows clears them
    assert mon.latest_progress()["rank"] == [] and _slow_links(mon) == []
