import json
from typing import Any, cast

import numpy as np
import pytest

from greyhound.core.detector import (
    METHODS,
    Detection,
    detect_many,
    detect_series,
    detector_from_state,
    make_detector,
)
from greyhound.core.levels import Stage, stage_view


def _slowdowns(dets: list[Detection], stage: Stage = "confirmed") -> list[Detection]:
    return [d for d in stage_view(dets, stage) if d.kind == "slowdown"]


def _trace(seed: int, n: int = 600, sigma: float = 0.02) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return 0.25 * np.exp(rng.normal(0.0, sigma, n))


@pytest.mark.parametrize("factor", [1.12, 1.3, 2.0, 3.0])
def test_bocdv_suspects_a_fail_slow_within_three_iterations_and_confirms_it_once_it_held(factor):
    x = _trace(10)
    x[300:420] *= factor
    dets = detect_series(x)
    (seen,) = _slowdowns(dets, "suspected")
    (slow,) = _slowdowns(dets)
    assert 300 <= seen.detected_at <= 303 + (3 if factor < 1.2 else 0)
    # confirmed once it held five points from its start (at once when seen on that many)
    assert slow.detected_at == max(seen.detected_at, slow.index + 4)
    assert slow.suspected_at == seen.detected_at and slow.index == seen.index
    assert abs(slow.index - 300) <= 2
    assert slow.after_s / slow.before_s == pytest.approx(factor, rel=0.05)
    rec = [d for d in dets if d.kind == "recovery"]
    assert len(rec) == 1 and 420 <= rec[0].detected_at <= 426


def test_bocdv_ignores_spikes_checkpoints_and_sub_ten_percent_steps():
    x = _trace(11)
    x[100] *= 3.0      # GC / data-loader spike
    x[200] *= 40.0     # checkpoint save
    x[201] *= 1.4      # slow iteration right after it
    x[350:] *= 1.05    # sub-10% step
    assert detect_series(x) == []


def test_plain_bocd_fires_on_a_step_validation_rejects():
    x = _trace(12, sigma=0.01)
    x[300:] *= 1.06
    assert detect_series(x, "bocd-v") == []
    assert any(d.kind == "slowdown" for d in detect_series(x, "bocd"))


def test_window_baseline_detects_a_clear_step():
    x = _trace(13)
    x[300:] *= 1.5
    dets = detect_series(x, "window")
    assert dets and dets[0].kind == "slowdown" and 300 <= dets[0].detected_at <= 304


@pytest.mark.parametrize("method", METHODS)
def test_detect_many_equals_detect_series(method):
    traces = [_trace(s, n=300 + 50 * s) for s in range(4)]
    for s, x in enumerate(traces):
        x[150:] *= 1.0 + 0.3 * s
    many = detect_many(traces, method)
    assert many == [detect_series(x, method) for x in traces]


@pytest.mark.parametrize("method", METHODS)
def test_restart_from_json_state(method):
    x = _trace(14)
    x[400:] *= 1.8
    a = make_detector(method)
    for v in x[:390]:
        a.update(v)
    b = detector_from_state(json.loads(json.dumps(a.state_dict(), allow_nan=False)))
    assert [a.update(v) for v in x[390:]] == [b.update(v) for v in x[390:]]


def test_unknown_method_and_parameter_are_errors():
    with pytest.raises(ValueError):
        make_detector(cast(Any, "nope"))
    with pytest.raises(ValueError):
        make_detector("bocd-v", bogus=1.0)


# Real training noise, seeded: what recorded H200 iteration times show.

def _real_noise(seed: int, n: int = 1500, sigma: float = 0.05,
                plateaus: bool = True) -> np.ndarray:
    """~5% jitter on plateaus that wander by a few percent, periodic evaluation spikes (one a
    4-iteration burst), checkpoints with a slow iteration after, and random GC / data-loader
    stalls."""
    rng = np.random.default_rng(seed)
    level = np.repeat(rng.uniform(0.96, 1.02, n // 350 + 2), 350)[175:175 + n]
    if not plateaus:
        level[:] = 1.0
    x = 0.02 * level * np.exp(rng.normal(0.0, sigma, n))
    for i in range(50, n, 100):
        x[i] *= rng.uniform(5.0, 30.0)
    x[750:754] *= 7.0  # an evaluation that takes four iterations
    for i in (400, 1200):
        x[i] *= 40.0
        x[i + 1] *= 1.4
    stalls = np.flatnonzero(rng.random(n) < 0.02)
    x[stalls] *= np.exp(rng.uniform(np.log(1.3), np.log(8.0), stalls.size))
    return x


@pytest.mark.parametrize("seed", range(6))
def test_real_noise_alone_raises_nothing(seed):
    x = _real_noise(seed)
    x[300:302] *= 2.0      # a two-iteration transient
    x[303] *= 1.8          # and a stall right after it
    x[900:903] *= 1.3      # three slow iterations
    assert [d for d in detect_series(x) if d.kind == "slowdown"] == []


@pytest.mark.parametrize(("factor", "within"), [(1.2, 12), (1.3, 5), (2.0, 4)])
@pytest.mark.parametrize("seed", range(4))
def test_sustained_slowdowns_in_real_noise_are_found_and_recover(seed, factor, within):
    """Steps of 20% and more: found in a few points (four from 30% on), placed at the step,
    measured, and their end reported as a full recovery."""
    x = _real_noise(10 + seed)
    x[600:1000] *= factor
    dets = detect_series(x)
    slow = _slowdowns(dets)
    assert len(slow) == 1 and len(_slowdowns(dets, "suspected")) == 1, dets
    assert 600 <= _slowdowns(dets, "suspected")[0].detected_at < 600 + within
    assert slow[0].change == "onset" and 600 <= slow[0].detected_at < 600 + max(within, 6), slow
    assert abs(slow[0].index - 600) <= 3
    assert slow[0].after_s / slow[0].before_s == pytest.approx(factor, rel=0.06)
    rec = [d for d in dets if d.kind == "recovery"]
    assert [d.change for d in rec] == ["full"] and 1000 <= rec[0].detected_at < 1012, rec


@pytest.mark.parametrize("seed", range(4))
def test_fifteen_percent_in_five_percent_jitter_is_found_as_evidence_allows(seed):
    """Close to the 10% threshold in that much noise the evidence takes tens of iterations;
    the start reported is that of the stretch that made the case. Seed 2's plateaus leave
    11.5% of the step in the data: it takes 20 iterations, during which the healthy level must
    not follow it."""
    x = _real_noise(10 + seed)
    x[600:1000] *= 1.15
    dets = detect_series(x)
    seen, slow = _slowdowns(dets, "suspected"), _slowdowns(dets)
    assert seen and 600 <= seen[0].detected_at < 640, dets
    assert 597 <= seen[0].index <= seen[0].detected_at - 3
    assert seen[0].after_s / seen[0].before_s > 1.1
    assert slow and slow[0].index == seen[0].index and slow[0].detected_at < 640, dets


@pytest.mark.parametrize("seed", range(4))
def test_a_ten_percent_step_in_quiet_noise_is_found(seed):
    rng = np.random.default_rng(20 + seed)
    x = 0.1 * np.exp(rng.normal(0.0, 0.01, 800))
    x[400:] *= 1.12
    slow = _slowdowns(detect_series(x))
    assert len(slow) == 1 and 404 <= slow[0].detected_at <= 406, slow


def test_slow_stream_reports_a_further_slowdown_and_a_partial_recovery():
    x = _real_noise(30, n=2000, plateaus=False)
    x[500:1500] *= 1.5   # the first fault
    x[900:1200] *= 1.3   # a second one on top of it, which ends first
    dets = stage_view(detect_series(x), "confirmed")
    got = [(d.kind, d.change) for d in dets]
    assert got == [("slowdown", "onset"), ("slowdown", "further"), ("recovery", "partial"),
                   ("recovery", "full")], dets
    onset, further, partial, full = dets
    assert 904 <= further.detected_at <= 906 and 1200 <= partial.detected_at <= 1206
    assert further.after_s / further.before_s == pytest.approx(1.3, rel=0.06)
    assert further.healthy_s == pytest.approx(onset.before_s)
    assert partial.after_s == pytest.approx(onset.after_s, rel=0.1)
    assert 1500 <= full.detected_at <= 1506
