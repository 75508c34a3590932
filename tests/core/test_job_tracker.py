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


def test_batched_messages_decide_like_one_value_at_a_time() -> None:
    """Agent flushes (several iterations of many ranks, ranks interleaved) change nothing."""
    rng = np.random.default_rng(4)
    series = 0.1 * (1 + 0.01 * rng.standard_normal((16, 260)))
    series[:, 120:] *= 1.3
    series[5, 40:60] *= 3.0  # one rank's noise
    one = JobTracker()
    expected = _feed(one, series)
    many = JobTracker()
    got = []
    it = 0
    while it < series.shape[1]:
        k = int(rng.integers(1, 7))
        ranks = np.repeat(np.arange(16), min(k, series.shape[1] - it))
        vals = series[:, it:it + k].reshape(-1)
        # Interleave the ranks at random, each rank's own values staying in order.
        labels = rng.permutation(ranks)
        mixed = np.empty_like(vals)
        mixed[np.argsort(labels, kind="stable")] = vals
        got += [(d.kind, d.ranks, d.first_iteration) for d in many.observe_many(labels, mixed)]
        it += k
    assert [(k, r) for _, k, r in expected] == [(k, r) for k, r, _ in got]
    assert [k for _, k, _ in expected] == ["slowdown"]
    assert many.updates == series.size  # every value of the last round went through too


def test_lagging_rank_does_not_block_the_others() -> None:
    t = JobTracker(max_lag=4)
    t.observe_many([0, 1, 2], [0.1, 0.1, 0.1])
    assert t.updates == 3
    t.observe_many([0, 1] * 5, [0.1] * 10)  # rank 2 went quiet
    assert t.updates == 3 + 2 * 5 - 2 * 3  # rounds go ahead once 4 values wait, without rank 2
    t.observe_many([2, 2], [0.1, 0.1])
    state = JobTracker.from_state(t.state_dict())
    assert state.state_dict()["pending"] == t.state_dict()["pending"]
