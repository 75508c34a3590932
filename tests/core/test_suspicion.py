"""Two stages, warm-up and restarts, and a slowdown right after a noisy stretch: BOCD+V on the
cases traces from outside the project showed it getting wrong."""

from __future__ import annotations

import json

import numpy as np
import pytest

from greyhound.core.detector import (
    Detection,
    detect_many,
    detect_series,
    detector_from_state,
    make_detector,
)
from greyhound.core.levels import stage_view
from greyhound.core.suspicion import held, recent_noise, settled


def _noise(seed: int, n: int, sigma: float = 0.04) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return 0.05 * np.exp(rng.normal(0.0, sigma, n))


def _confirmed(dets: list[Detection]) -> list[Detection]:
    return [d for d in stage_view(dets, "confirmed") if d.kind == "slowdown"]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("length", "factor"), [(3, 2.2), (4, 1.5), (4, 2.2)])
def test_a_short_transient_is_suspected_then_withdrawn_never_confirmed(seed, length, factor):
    """The false alarms on unseen hostile traces: 4 iterations at 1.5-2.2x, reported on their
    third. They may start a profile, never a pause."""
    x = _noise(seed, 600)
    x[300:300 + length] *= factor
    dets = detect_series(x)
    assert _confirmed(dets) == []
    assert [(d.kind, d.change, d.stage) for d in dets] in (
        [], [("slowdown", "onset", "suspected"), ("recovery", "withdrawn", "confirmed")])
    if dets:
        assert 300 <= dets[0].index <= 301 and dets[1].detected_at < 300 + length + 8


def test_a_burst_next_to_a_stall_is_not_a_five_iteration_level():
    """A 4-iteration burst with a GC stall right before it: five slow points, the stall off the
    burst's level."""
    x = _noise(5, 600, sigma=0.02)
    x[300] *= 1.5
    x[301:305] *= 2.0
    assert _confirmed(detect_series(x)) == []


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("spike", [5.0, 20.0])
def test_a_burst_after_an_evaluation_step_is_no_five_iteration_level(seed, spike):
    """An evaluation step (left out of the evidence as a spike) and a 4-iteration burst right
    after it: five points since the change, four at its level. Seen on hostile traces, where
    the burst was confirmed at once, as a level that had held five points."""
    x = _noise(seed, 600, sigma=0.01)
    x[300] *= spike
    x[301:305] *= 2.3
    dets = detect_series(x)
    assert _confirmed(dets) == []
    assert [d.stage for d in dets if d.kind == "slowdown"] in ([], ["suspected"])


@pytest.mark.parametrize("seed", range(6))
def test_a_slowdown_right_after_a_long_noisy_stretch_is_found(seed):
    """The missed real episode: ~44 iterations at 1.2x beginning 40 iterations after 300 of
    flickering contention (x1.12-2.1). It must be confirmed with its start within 10 of the
    truth and by 15 iterations in, as the recorded traces are scored; the stretch's end must
    not have been taken for the start of a new healthy level or a new noise scale."""
    rng = np.random.default_rng(100 + seed)
    x = _noise(seed, 1200, sigma=0.05)
    x[300:600] *= rng.uniform(1.12, 2.08, 300)
    x[640:684] *= 1.2
    found = [d for d in _confirmed(detect_series(x)) if 620 <= d.detected_at < 700]
    assert found and 634 <= found[0].index <= 650 and found[0].detected_at <= 655, found


#: Contention that flickers: slow on three iterations of five, or on one of three.
MOST = [1, 1, 0, 1, 0]
THIRD = [1, 0, 0]


def _flicker(seed: int, pattern: list[int], factor: float) -> np.ndarray:
    """Quiet noise (3% jitter) and 30 iterations of contention from 400 on: the iterations
    ``pattern`` (repeated) marks ``factor`` slower."""
    x = _noise(seed, 800, sigma=0.03)
    x[400:430][np.resize(np.asarray(pattern, dtype=bool), 30)] *= factor
    return x


@pytest.mark.parametrize("seed", range(6))
def test_contention_that_flickers_on_most_iterations_is_found_by_its_median(seed):
    """Three iterations of five 1.25x slower for 30 iterations: a fail-slow by the labels (the
    median of 9 above the threshold for 8 and more), whose mean is 15% with two points of five
    back at the old level, which the mean and its persistence refuse (nothing is found without
    the median path). The median path finds it within 15 iterations, confirmed as it is raised,
    from about where it began."""
    x = _flicker(seed, MOST, 1.25)
    found = [d for d in _confirmed(detect_series(x)) if 400 <= d.detected_at < 460]
    assert found and 394 <= found[0].index <= 410 and found[0].detected_at <= 415, found
    assert _confirmed(detect_many([x], median_run=0)[0]) == []


@pytest.mark.parametrize("seed", range(6))
def test_flicker_on_a_third_of_the_iterations_or_under_the_threshold_is_no_slowdown(seed):
    """A median is slow only when most points are: every third point slow, or three of five at
    1.08x, is no fail-slow by the labels, and nothing is confirmed."""
    for pattern, factor in ((THIRD, 1.25), (MOST, 1.08)):
        assert _confirmed(detect_series(_flicker(seed, pattern, factor))) == []


def test_a_restored_detector_continues_a_run_of_high_medians_identically():
    x = _flicker(0, MOST, 1.25)
    a = make_detector("bocd-v")
    for v in x[:406]:
        a.update(float(v))
    b = detector_from_state(json.loads(json.dumps(a.state_dict(), allow_nan=False)))
    for v in x[406:]:
        assert a.update(float(v)) == b.update(float(v))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("shape", ["fast", "slow", "compiling"])
def test_warm_up_is_no_change_point(seed, shape):
    """The first iterations of a job are not a change point, whichever way they go: faster
    ones (a pipeline not yet full), slower ones decaying (caches, allocator), or steps not yet
    compiled alternating with compiled ones."""
    rng = np.random.default_rng(seed)
    x = _noise(seed, 400)
    if shape == "fast":
        x[:30] *= 0.3
    elif shape == "slow":
        x[:60] *= np.exp(np.log(2.5) * np.exp(-np.arange(60) / 15.0))
    else:
        x[:50] *= np.where(rng.random(50) < 0.4, 6.0, 1.0)
    assert detect_series(x) == []


@pytest.mark.parametrize("seed", range(3))
def test_a_restarted_stream_warms_up_again_and_keeps_its_slow_state(seed):
    """After a restart (a rank's iteration numbers went back) the stream decides nothing
    until its level settles: a faster restart phase raises nothing. A stream that was slow
    before stays slow, and its recovery after the restart is judged against the same healthy
    level."""
    x = _noise(seed, 900)
    det = make_detector("bocd-v")
    batch = det.batch  # type: ignore[attr-defined]
    out = [det.update(v) for v in x[:400]]
    assert [d for d in out if d] == []
    batch.restart([0])
    restart = x[400:700].copy()
    restart[:25] *= 0.4     # its first iterations come faster
    out = [det.update(v) for v in restart]
    assert [d for d in out if d] == []
    # slow, then a restart, then healthy again: a full recovery after it settles
    slow = x[700:900].copy() * 1.5
    out = [det.update(v) for v in slow[:100]]
    assert [d.change for d in out if d and d.stage == "confirmed"] == ["onset"]
    batch.restart([0])
    out = [det.update(v) for v in x[800:900]]
    got = [d for d in out if d]
    assert [(d.kind, d.change) for d in got] == [("recovery", "full")], got


def test_held_waits_for_the_end_of_a_transient_and_confirms_a_level():
    y = np.log(np.array([[2.0, 2.0, 2.0, 2.0, 1.0, 1.0],     # a burst that ended
                         [2.0, 2.0, 2.0, 2.0, 2.0, 1.6],     # still slow, but leaving
                         [2.0, 2.1, 1.9, 2.0, 2.05, 1.95],   # a level
                         [1.5, 2.0, 2.0, 2.0, 2.0, 1.0]]))   # stall, burst, back
    run = np.ones_like(y, dtype=bool)
    got = held(y, run, np.zeros(4), np.full(4, 0.03), rel=0.1, z=2.0, spike=4.0, least=5,
               share=3)
    assert got.ok.tolist() == [False, False, True, False]


def test_settled_and_recent_noise():
    rng = np.random.default_rng(0)
    steady = rng.normal(0.0, 0.02, (1, 20))
    rising = steady + np.linspace(0.0, 0.5, 20)
    valid = np.ones((1, 20), dtype=bool)
    assert settled(steady, valid, 8, np.log(1.05)).tolist() == [True]
    assert settled(rising, valid, 8, np.log(1.05)).tolist() == [False]
    noisy = np.concatenate([rng.normal(0, 0.3, (1, 8)), rng.normal(0, 0.02, (1, 24))], axis=1)
    est = recent_noise(noisy, np.ones_like(noisy, dtype=bool), np.array([0.3]), floor=0.004)
    assert 0.01 < est[0] < 0.05  # the noisy quarter of the window does not count
