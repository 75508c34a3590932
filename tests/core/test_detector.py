import json
from typing import Any, cast

import numpy as np
import pytest

from greyhound.core.detector import (
    METHODS,
    detect_many,
    detect_series,
    detector_from_state,
    make_detector,
)


def _trace(seed: int, n: int = 600, sigma: float = 0.02) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return 0.25 * np.exp(rng.normal(0.0, sigma, n))


@pytest.mark.parametrize("factor", [1.12, 1.3, 2.0, 3.0])
def test_bocdv_catches_a_fail_slow_within_three_iterations(factor):
    x = _trace(10)
    x[300:420] *= factor
    dets = detect_series(x)
    slow = [d for d in dets if d.kind == "slowdown"]
    assert len(slow) == 1
    assert 300 <= slow[0].detected_at <= 303 + (3 if factor < 1.2 else 0)
    assert abs(slow[0].index - 300) <= 2
    assert slow[0].after_s / slow[0].before_s == pytest.approx(factor, rel=0.05)
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
