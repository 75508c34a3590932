"""Recurring bursts are learned from their regularity, flagged when they come as expected, and
forgotten when they stop; a detector built on it does not report them."""

from __future__ import annotations

import json

import numpy as np

from greyhound.core.detector import detect_series, detector_from_state, make_detector
from greyhound.core.levels import stage_view
from greyhound.core.recurring import RecurringBursts


def _feed(rb: RecurringBursts, elevated: np.ndarray) -> np.ndarray:
    rows = np.arange(elevated.shape[0])
    out = np.zeros_like(elevated)
    for t in range(elevated.shape[1]):
        out[:, t] = rb.observe(rows, np.full(rows.size, t, dtype=np.int64), elevated[:, t])
    return out


def test_a_period_is_learned_after_three_bursts_and_its_bursts_are_expected() -> None:
    e = np.zeros((2, 1000), dtype=bool)
    for s in range(100, 1000, 150):
        e[0, s:s + 4] = True           # every 150 iterations, 4 long
    e[1, [100, 260, 390, 700]] = True  # irregular: never learned
    rng = np.random.default_rng(0)
    e[0, rng.integers(0, 1000, 10)] = True  # stalls at random in between
    got = _feed(RecurringBursts(2), e)
    assert not got[0, :400].any()  # bursts at 100, 250, 400: learned at the end of the third
    for s in range(550, 1000, 150):
        assert got[0, s:s + 4].all(), s
    assert not got[1].any()
    assert not (got[0] & ~e[0]).any()  # only elevated points are ever expected


def test_a_burst_that_lasts_is_expected_only_for_the_learned_length() -> None:
    e = np.zeros((1, 1200), dtype=bool)
    for s in range(100, 1200, 200):
        e[0, s:s + 3] = True
    e[0, 700:712] = True  # a slowdown that begins with the evaluation at 700
    got = _feed(RecurringBursts(1), e)[0]
    assert got[700:703].all() and not got[704:712].any()
    assert got[900:903].all()  # and it did not teach a longer burst
    assert not got[903]


def test_a_period_whose_bursts_stop_is_forgotten() -> None:
    e = np.zeros((1, 2000), dtype=bool)
    for s in range(100, 800, 100):
        e[0, s:s + 2] = True
    rb = RecurringBursts(1)
    _feed(rb, e)
    assert rb.period[0] == 0
    e2 = np.zeros((1, 1), dtype=bool)
    e2[0, 0] = True
    assert not rb.observe(np.arange(1), np.array([2000]), e2[:, 0]).any()


def test_state_round_trip() -> None:
    e = np.zeros((1, 700), dtype=bool)
    for s in range(50, 700, 120):
        e[0, s:s + 2] = True
    a = RecurringBursts(1)
    _feed(a, e[:, :400])
    b = RecurringBursts.from_state(json.loads(json.dumps(a.state_dict())))
    rows = np.arange(1)
    for t in range(400, 700):
        ta = np.array([t], dtype=np.int64)
        assert (a.observe(rows, ta, e[:, t]) == b.observe(rows, ta, e[:, t])).all()


def _evals(seed: int, n: int = 3000) -> np.ndarray:
    """Every 300 iterations an evaluation: a x12 step, then five iterations at x2.5."""
    rng = np.random.default_rng(seed)
    x = 0.05 * np.exp(rng.normal(0.0, 0.03, n))
    for s in range(200, n, 300):
        x[s] *= 12.0
        x[s + 1:s + 6] *= 2.5
    return x


def test_recurring_evaluations_are_not_reported_once_learned() -> None:
    for seed in range(3):
        x = _evals(seed)
        slow = [d for d in detect_series(x) if d.kind == "slowdown"]
        # The first three come before the period is known; none after.
        assert all(d.index < 900 for d in slow), slow
        det = make_detector("bocd-v", learn=0.0)
        unlearned = [d for v in x if (d := det.update(v)) is not None and d.kind == "slowdown"]
        assert len(unlearned) >= 9


def test_a_slowdown_between_or_at_evaluations_is_still_found() -> None:
    x = _evals(4)
    x[1650:1800] *= 1.4   # between two evaluations, with one (1700) inside it
    x[2600:2800] *= 1.3   # starting together with the evaluation at 2600
    slow = [d for d in stage_view(detect_series(x), "confirmed")
            if d.kind == "slowdown" and d.index >= 900]
    assert [(d.change, d.index) for d in slow] == [("onset", 1650), ("onset", slow[1].index)]
    assert 1650 <= slow[0].suspected_at <= 1654 and slow[0].detected_at == 1654
    assert slow[1].index >= 2600 and slow[1].detected_at <= 2600 + 6 + 5


def test_detector_state_keeps_what_it_learned() -> None:
    """Restarted in the middle of an expected burst, the detector goes on identically."""
    x = _evals(5)
    a = make_detector("bocd-v")
    for v in x[:1103]:
        a.update(v)
    b = detector_from_state(json.loads(json.dumps(a.state_dict())))
    assert [a.update(v) for v in x[1103:]] == [b.update(v) for v in x[1103:]]
