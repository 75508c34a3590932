"""The job's iteration series as the planner keeps it: one rank's times, each once, and where a
given moment falls in them (an escalation counts only the iterations since its fault began)."""

from __future__ import annotations

from services.common.bus.contract import IterationBatch
from services.planner.iterations import IterationSeries, onset_lead_s


def batch(ts: float, first: int, times: list[float], rank: int = 0) -> IterationBatch:
    n = len(times)
    return IterationBatch(job_id="j", agent_id="a", ts=ts, rank=[rank] * n,
                          iteration=list(range(first, first + n)), end_ns=[0] * n,
                          duration_s=times)


def test_position_at_splits_the_series_by_the_batches_send_time() -> None:
    s = IterationSeries()
    s.take(batch(100.0, 0, [1.0, 1.0]))
    s.take(batch(110.0, 2, [2.0, 2.0, 2.0]))
    s.take(batch(120.0, 5, [3.0]))
    assert s.position_at(50.0) == 0
    assert s.position_at(105.0) == 2  # the first batch is before, the rest after
    assert s.position_at(110.0) == 2  # sent at the moment counts as after
    assert s.position_at(121.0) == 6  # nothing sent since
    assert s.since(s.position_at(105.0)) == [2.0, 2.0, 2.0, 3.0]


def test_since_can_skip_what_was_sent_before_a_moment() -> None:
    s = IterationSeries()
    s.take(batch(100.0, 0, [1.0, 1.5]))
    s.take(batch(110.0, 2, [2.0]))
    assert s.since(0) == [1.0, 1.5, 2.0]
    assert s.since(0, sent_from=105.0) == [2.0]
    assert s.since(2, sent_from=50.0) == [2.0]
    assert s.since(3, sent_from=50.0) == []


def test_positions_stay_right_once_old_times_are_forgotten() -> None:
    s = IterationSeries(keep=3)
    for i in range(5):
        s.take(batch(100.0 + i, i, [float(i + 1)]))
    assert s.count == 5 and list(s.recent) == [3.0, 4.0, 5.0]
    assert s.position_at(0.0) == 2  # as far back as is kept
    assert s.position_at(103.5) == 4
    assert s.since(1, sent_from=103.0) == [4.0, 5.0]


def test_only_the_lowest_rank_counts() -> None:
    s = IterationSeries()
    s.take(batch(100.0, 0, [9.0], rank=3))
    s.take(batch(101.0, 0, [1.0], rank=1))  # a lower rank: the series starts over with it
    s.take(batch(102.0, 1, [8.0], rank=3))
    assert s.rank == 1 and s.since(1) == [1.0] and s.position_at(101.0) == 1


def test_the_onset_lead_is_the_slow_iterations_and_three_more_within_the_lookback() -> None:
    assert onset_lead_s(10, 12, 2.0, 120.0) == 10.0
    assert onset_lead_s(10, 10, 0.1, 120.0) == 1.0  # at least a second
    assert onset_lead_s(0, 500, 2.0, 120.0) == 120.0
    assert onset_lead_s(12, 10, 2.0, 120.0) == 6.0  # numbers out of order: three iterations
