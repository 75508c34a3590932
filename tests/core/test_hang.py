import numpy as np
import pytest

from greyhound.core.hang import HangPolicy


def test_threshold_is_floor_multiple_or_learned_allowance():
    p = HangPolicy(floor_s=10.0, multiple=20.0, margin=1.5)
    assert p.threshold_s() == 10.0
    for _ in range(50):
        p.observe_iteration(2.0)
    assert p.threshold_s() == pytest.approx(40.0)
    p.observe_iteration(200.0)  # checkpoint: remembered as a long normal phase
    assert p.threshold_s() == pytest.approx(300.0)
    assert p.typical_s() == pytest.approx(2.0)


def test_a_pause_that_ended_is_allowed_next_time_with_margin() -> None:
    p = HangPolicy(floor_s=60.0, multiple=20.0, margin=1.5)
    for _ in range(100):
        p.observe_iteration(1.0)
    assert p.threshold_s() == 60.0  # a 90 s checkpoint would alarm the first time
    p.observe_recovered_pause(90.0)
    assert p.threshold_s() == pytest.approx(135.0)  # ... and not the next times
    p.observe_recovered_pause(0.0)  # no pause: nothing learned
    assert p.threshold_s() == pytest.approx(135.0)


def test_iterations_shorter_than_the_floor_keep_the_floor() -> None:
    rng = np.random.default_rng(2)
    p = HangPolicy(floor_s=60.0)
    for d in 0.02 * np.exp(rng.normal(0, 0.05, 3000)):
        p.observe_iteration(float(d))
    assert p.threshold_s() == 60.0 and p.typical_s() == pytest.approx(0.02, rel=0.05)


def test_bad_policy_is_refused() -> None:
    with pytest.raises(ValueError):
        HangPolicy(floor_s=0.0)
    with pytest.raises(ValueError):
        HangPolicy(margin=0.5)
