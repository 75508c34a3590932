"""Job-level quorum over per-rank detectors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from greyhound.core.job_tracker import JobDetection, JobTracker


def _feed(tracker: JobTracker, series: np.ndarray) -> list[tuple[int, str, tuple[int, ...]]]:
    """The job's decisions as they may pause it: suspicions left out."""
    out = []
    for it in range(series.shape[1]):
        for rank in range(series.shape[0]):
            d = tracker.observe(rank, float(series[rank, it]))
            if d is not None and d.stage == "confirmed":
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
    assert 104 <= slow_at <= 106
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
        got += [(d.kind, d.ranks, d.first_iteration) for d in many.observe_many(labels, mixed)
                if d.stage == "confirmed"]
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


def _job_events(tracker: JobTracker, series: np.ndarray, late: dict[int, int] | None = None
                ) -> list[tuple[int, str, str, float, float]]:
    """Feed a (ranks, iterations) grid one round at a time; ranks in `late` lag that many
    rounds behind (their values arrive later), as a slow agent's would."""
    late = late or {}
    out = []
    ranks, n = series.shape
    lag = max(late.values(), default=0)
    for it in range(n + lag):
        rs = [r for r in range(ranks) if 0 <= it - late.get(r, 0) < n]
        vals = [series[r, it - late.get(r, 0)] for r in rs]
        for d in tracker.observe_many(rs, vals):
            if d.stage == "confirmed":
                out.append((it, d.kind, d.change, d.before_s, d.after_s))
    return out


def test_a_slow_job_reports_a_further_slowdown_then_a_partial_and_a_full_recovery() -> None:
    rng = np.random.default_rng(5)
    x = 0.1 * np.exp(0.03 * rng.standard_normal((8, 500)))
    x[:, 100:400] *= 1.5    # a slow GPU
    x[:, 200:300] *= 1.3    # a congested link on top of it, cleared at 300
    x[:, 150] *= 10.0       # a checkpoint
    x[3, 250:260] *= 2.0    # one rank's own noise while slow
    events = _job_events(JobTracker(), x, late={6: 3, 7: 5})
    assert [(k, c) for _, k, c, _, _ in events] == [
        ("slowdown", "onset"), ("slowdown", "further"), ("recovery", "partial"),
        ("recovery", "full")], events
    (t1, *_, b1, a1), (t2, *_, b2, a2), (t3, *_, b3, a3), (t4, *_, b4, a4) = events
    assert b4 == pytest.approx(a3, rel=0.05)
    assert 104 <= t1 <= 106 and 204 <= t2 <= 206 and 300 <= t3 <= 304 and 400 <= t4 <= 404
    assert a1 / b1 == pytest.approx(1.5, rel=0.05)
    assert a2 / b2 == pytest.approx(1.3, rel=0.05) and b2 == pytest.approx(a1, rel=0.05)
    assert b3 / a3 == pytest.approx(1.3, rel=0.05)
    assert a4 == pytest.approx(b1, rel=0.05)


def test_ranks_that_report_a_change_late_do_not_make_a_second_one() -> None:
    """Half the ranks see the further slowdown a few rounds after the others (their agent
    flushes late): one decision, not two."""
    rng = np.random.default_rng(6)
    x = 0.1 * np.exp(0.02 * rng.standard_normal((8, 400)))
    x[:, 100:] *= 1.5
    x[:, 200:] *= 1.3
    events = _job_events(JobTracker(), x, late={4: 6, 5: 6, 6: 7, 7: 7})
    assert [c for _, _, c, _, _ in events] == ["onset", "further"], events


def test_further_state_survives_a_restart() -> None:
    rng = np.random.default_rng(7)
    x = 0.1 * np.exp(0.02 * rng.standard_normal((4, 400)))
    x[:, 100:] *= 1.5
    x[:, 250:] *= 1.3
    a = JobTracker()
    _job_events(a, x[:, :180])
    b = JobTracker.from_state(json.loads(json.dumps(a.state_dict())))
    rest_a, rest_b = _job_events(a, x[:, 180:]), _job_events(b, x[:, 180:])
    assert rest_a == rest_b and [c for _, _, c, _, _ in rest_a] == ["further"]


def test_a_blip_on_half_the_ranks_is_reported_over() -> None:
    """Two of four ranks slow for a few iterations (host contention on a busy machine): the
    onset, then the full recovery, although it began within `settle` rounds of the onset. It
    used to find no rank to name and raise, which dropped the tracker's message. A blip shorter
    than a fail-slow is only suspected, and withdrawn."""
    for seed, blip, want in ((0, 4, [("slowdown", "onset", "suspected"),
                                     ("recovery", "withdrawn", "confirmed")]),
                             (1, 8, [("slowdown", "onset", "suspected"),
                                     ("slowdown", "onset", "confirmed"),
                                     ("recovery", "full", "confirmed")]),
                             (2, 14, [("slowdown", "onset", "suspected"),
                                      ("slowdown", "onset", "confirmed"),
                                      ("recovery", "full", "confirmed")])):
        rng = np.random.default_rng(seed)
        x = 0.045 * np.exp(0.03 * rng.standard_normal((4, 200)))
        x[2:, 100:100 + blip] *= 1.5
        t = JobTracker()
        events = [(it, d) for it in range(200) for d in t.observe_many(range(4), x[:, it])]
        assert [(d.kind, d.change, d.stage) for _, d in events] == want, (seed, blip, events)
        assert events[-1][0] <= 100 + blip + 8, events


def test_a_slowdown_shorter_than_settle_still_recovers() -> None:
    """Its recoveries begin within ``settle`` rounds of the onset: the full recovery names them
    (it once failed on an empty rank list, and the tracker dead-lettered the batch)."""
    rng = np.random.default_rng(9)
    series = 0.1 * (1 + 0.01 * rng.standard_normal((4, 200)))
    series[:, 100:110] *= 2.0
    kinds = [k for _, k, _ in _feed(JobTracker(settle=64), series)]
    assert kinds[:1] == ["slowdown"] and kinds[-1:] == ["recovery"], kinds


def test_memory_follows_ranks_not_their_values() -> None:
    """A rank of 2^31-1 costs one index entry; a thousand values of one rank in one call are
    taken in slices, so the pending queue stays a few rounds deep."""
    t = JobTracker(max_ranks=4)
    t.observe_many([0, 1, 2, 2**31 - 1], [0.1] * 4)
    assert t._keys.nbytes + t._vals.nbytes <= 64
    t.observe_many([0] * 1000, [0.1] * 1000)
    assert t._queue.buf.shape[1] <= 2 * (t.max_lag + 64)
    assert t.updates >= 990  # the values went through, not dropped


def test_bad_input_is_refused_before_anything_is_observed() -> None:
    from greyhound.core.job_tracker import TooManyRanks

    t = JobTracker(max_ranks=2)
    t.observe_many([0, 1], [0.1, 0.1])
    state = json.dumps(t.state_dict())
    for ranks, values, err in (([0, 5], [0.1, 0.1], TooManyRanks), ([0, -1], [0.1, 0.1], ValueError),
                               ([0, 1], [0.1, float("inf")], ValueError),
                               ([0, 1], [0.1, 0.0], ValueError)):
        with pytest.raises(err):
            t.observe_many(ranks, values)
        assert json.dumps(t.state_dict()) == state


def _job(seed: int, ranks: int = 8, n: int = 400, sigma: float = 0.02) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return 0.2 * np.exp(sigma * rng.standard_normal((ranks, n)))


def _all(t: JobTracker, x: np.ndarray, first: int = 0,
         numbers: np.ndarray | None = None) -> list[tuple[int, JobDetection]]:
    """Every decision, one round of all ranks at a time (with their iteration numbers)."""
    out = []
    for it in range(x.shape[1]):
        its = None if numbers is None else numbers[:, it]
        out += [(first + it, d) for d in t.observe_many(range(x.shape[0]), x[:, it], its)]
    return out


@pytest.mark.parametrize("seed", range(3))
def test_a_jobs_warm_up_raises_nothing(seed: int) -> None:
    """Issue 18: a 64-GPU job's first iterations made false slowdowns. Whether they come fast
    (a pipeline filling: 40 iterations at a fifth of the time) or slow and decaying, the job's
    warm-up is not a change point."""
    x = _job(seed)
    x[:, :40] *= 0.2
    assert _all(JobTracker(), x) == []
    y = _job(seed + 10)
    y[:, :60] *= np.exp(np.log(3.0) * np.exp(-np.arange(60) / 12.0))
    assert _all(JobTracker(), y) == []


def test_a_rank_restart_whose_iteration_numbers_go_back_raises_nothing() -> None:
    """Half the ranks restart at iteration 200 (new processes: their agent counts from 0 again)
    and warm up 30 iterations at a fifth of the time: no slowdown. A real slowdown later is
    still found, and measured against the job's healthy level."""
    x = _job(4, n=600)
    numbers = np.tile(np.arange(600), (8, 1))
    numbers[4:, 200:] -= 200
    x[4:, 200:230] *= 0.2
    x[:, 450:] *= 1.5
    t = JobTracker()
    events = _all(t, x, numbers=numbers)
    assert [(d.kind, d.change, d.stage) for _, d in events] == [
        ("slowdown", "onset", "suspected"), ("slowdown", "onset", "confirmed")], events
    assert 450 <= events[1][0] <= 456 and events[1][1].suspected_iteration < 455
    assert events[1][1].after_s / events[1][1].before_s == pytest.approx(1.5, rel=0.05)


def test_without_the_iteration_numbers_a_restart_would_be_a_slowdown() -> None:
    """The same restart, its iteration numbers unknown: the restarted ranks' fast start and
    their return to the job's level read as a change, which is why the tracker passes them."""
    x = _job(4, n=400)
    x[:, 200:230] *= 0.2
    assert any(d.kind == "slowdown" for _, d in _all(JobTracker(), x))


def test_a_short_burst_on_every_rank_is_suspected_then_withdrawn() -> None:
    """Four iterations at 2x on the whole job (another job's burst on the network): suspected,
    so the analyzer may start profiling, and withdrawn, so nothing pauses the job; a fail-slow
    is suspected, then confirmed, with both moments."""
    x = _job(5)
    x[:, 150:154] *= 2.0
    x[:, 300:] *= 1.6
    events = _all(JobTracker(), x)
    got = [(it, d.kind, d.change, d.stage) for it, d in events]
    assert [g[1:] for g in got] == [
        ("slowdown", "onset", "suspected"), ("recovery", "withdrawn", "confirmed"),
        ("slowdown", "onset", "suspected"), ("slowdown", "onset", "confirmed")], got
    assert 150 <= got[0][0] <= 153 and got[1][0] <= 162
    sus, conf = events[2][1], events[3][1]
    assert conf.suspected_iteration == sus.detected_iteration <= conf.detected_iteration
    assert conf.first_iteration == sus.first_iteration == 300


def test_a_pending_suspicion_survives_a_tracker_restart() -> None:
    x = _job(6)
    x[:, 200:] *= 1.6
    a = JobTracker()
    first = _all(a, x[:, :204])
    assert [d.stage for _, d in first] == ["suspected"] and a.pending is not None
    b = JobTracker.from_state(json.loads(json.dumps(a.state_dict())))
    assert b.pending == a.pending
    rest_a, rest_b = _all(a, x[:, 204:]), _all(b, x[:, 204:])
    assert rest_a == rest_b and [d.stage for _, d in rest_a] == ["confirmed"]
