"""Job-level quorum over per-rank detectors."""

from __future__ import annotations

import numpy as np

from greyhound.core.job_tracker import JobTracker


def _feed(tracker: JobTracker, series: np.ndarray) -> list[tuple[int, str, tuple[int, ...]]]:
    out = []
    for it in range(series.shape[1]):
        for rank in range(series.shape[0]):
            d = tracker.observe(rank, float(series[rank, it]))
            if d is not None:
                out.append((it, d.kind, d.ranks))
    return out


def test_sync_slowdown_fires_once_then_recovers() -> None:
    rng = np.random.default_rng(1)
    base = 0.1 * (1 + 0.01 * rng.standard_normal((8, 300)))
    base[:, 100:200] *= 1.5
    events = _feed(JobTracker(), base)
    kinds = [k for _, k, _ in events]
    assert kinds == ["slowdown", "recovery"], events
    slow_at, _, ranks = events[0]
    assert 100 <= slow_at <= 104
    assert len(ranks) >= 4
    assert 200 <= events[1][0] <= 206


def test_one_noisy_rank_does_not_make_a_job_incident() -> None:
    rng = np.random.default_rng(2)
    base = 0.1 * (1 + 0.01 * rng.standard_normal((8, 300)))
    base[3, 150:170] *= 1.4  # one rank's measurement only: not a synchronous slowdown
    assert [k for _, k, _ in _feed(JobTracker(), base)] == []


def test_state_round_trip_keeps_decisions() -> None:
    rng = np.random.default_rng(3)
    series = 0.1 * (1 + 0.01 * rng.standard_normal((4, 200)))
    series[:, 150:] *= 1.3
    a = JobTracker()
    _feed(a, series[:, :120])
    b = JobTracker.from_state(a.state_dict())
    ev_a = _feed(a, series[:, 120:])
    ev_b = _feed(b, series[:, 120:])
    assert ev_a == ev_b and [k for _, k, _ in ev_a] == ["slowdown"]
