"""The live runs' pacer: real time around onsets and while the services work on the job, faster
otherwise, lowered while the tracker lags, and an account of where the wall time went."""

from __future__ import annotations

import pytest

from greyhound.sim.pace import PacePolicy, Pacer

POLICY = PacePolicy(fast=8.0, slow=1.0, lead_s=3.0, window_s=60.0, lag_high=100, lag_low=10,
                    adjust_every_s=1.0)


def test_real_time_from_lead_before_an_onset_until_settled_or_the_window_ends() -> None:
    p = Pacer(POLICY, [100.0, 500.0])
    assert (p.speed(50.0, 0.0), p.mode) == (8.0, "fast")
    assert (p.speed(97.5, 10.0), p.mode) == (1.0, "reaction")
    assert p.speed(150.0, 60.0) == 1.0  # still open: nobody settled it
    assert p.speed(160.0, 70.0) == 8.0  # the window (60 s) is over
    p.settle(1)
    assert p.speed(497.0, 80.0) == 8.0  # settled before its onset: no reason to slow down
    q = Pacer(POLICY, [100.0])
    q.speed(99.0, 0.0)
    q.settle(0)
    assert q.speed(101.0, 2.0) == 8.0 and q.reacting(101.0) == []


def test_real_time_while_the_services_profile_or_pause_the_job() -> None:
    p = Pacer(POLICY, [])
    assert (p.speed(10.0, 0.0, busy=True), p.mode) == (1.0, "busy")
    assert p.speed(11.0, 1.0, busy=False) == 8.0


def test_tracker_lag_halves_the_pace_at_most_once_a_second_and_it_grows_back() -> None:
    p = Pacer(POLICY, [])
    assert p.speed(0.0, 0.0, lag=500) == 4.0
    assert p.speed(0.1, 0.5, lag=500) == 4.0  # not again within adjust_every_s
    assert p.speed(0.2, 1.0, lag=500) == 2.0
    for k in range(2, 10):
        p.speed(0.3 + k, float(k), lag=500)
    assert p.factor == POLICY.min_factor
    assert p.speed(20.0, 20.0, lag=50) == pytest.approx(8.0 * POLICY.min_factor)  # in between
    for k in range(21, 40):
        p.speed(float(k), float(k), lag=0)
    assert p.factor == 1.0
    assert p.report().lagged_s > 0


def test_report_accounts_wall_and_virtual_time_by_mode() -> None:
    p = Pacer(POLICY, [100.0])
    p.speed(0.0, 0.0)  # fast from here
    p.speed(80.0, 10.0)  # 80 virtual s in 10 wall s, fast
    p.speed(97.0, 12.0)  # fast until the reaction window opens at 97
    p.speed(117.0, 32.0)  # 20 virtual s in 20 wall s at real time
    r = p.report()
    assert r.modes["fast"].virtual_s == 97.0 and r.modes["fast"].wall_s == 12.0
    assert r.modes["reaction"].speed == pytest.approx(1.0)
    assert "achieved 1.00x" in r.describe() and r.lagged_s == 0.0


def test_bad_policies_are_refused() -> None:
    for bad in ({"fast": 0.0}, {"window_s": 0.0}, {"lag_low": 5, "lag_high": 1},
                {"min_factor": 0.0}):
        with pytest.raises(ValueError):
            PacePolicy(**bad)


def test_real_time_around_an_end_until_what_was_done_for_it_is_taken_back() -> None:
    """Issue 23: an S2 plan left in force after its fault ended slowed the healthy job by 13%
    and lifted the tracker's baseline over the next weak fault; its revert waits on the
    planner's wall-clock re-checks, so the end is paced like an onset until it is settled."""
    p = Pacer(POLICY, [100.0], ends=[200.0])
    assert p.speed(170.0, 0.0) == 8.0 and p.ending(170.0) == []
    assert (p.speed(198.0, 10.0), p.mode) == (1.0, "reaction") and p.ending(198.0) == [0]
    assert p.speed(250.0, 60.0) == 1.0  # still in force
    p.settle_end(0)
    assert p.speed(251.0, 61.0) == 8.0 and p.ending(251.0) == []
    q = Pacer(POLICY, [100.0], ends=[200.0])
    assert q.speed(260.5, 0.0) == 8.0  # the window (60 s) is over
