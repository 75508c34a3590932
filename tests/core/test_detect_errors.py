"""scripts/detect_errors.py names each error with the noise labelled around it: a healthy job
whose labelled noise is a 1.3x step is a false alarm explained by that step, an episode nothing
raised is a miss, and a detected episode is neither."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np

from greyhound.core.detector import detect_many
from greyhound.traces.labels import Episode, NoiseEvent, Trace

ROOT = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("detect_errors",
                                                  ROOT / "scripts" / "detect_errors.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _flat(n: int, seed: int) -> np.ndarray:
    return 1.0 + 0.01 * np.random.default_rng(seed).standard_normal(n)


def test_false_alarms_and_misses_are_named_with_their_noise() -> None:
    errors = _script().errors
    healthy = Trace("quiet", _flat(600, 1))
    stepped = _flat(600, 2)
    stepped[300:] *= 1.3  # labelled noise, though a detector must call it a slowdown
    noisy = Trace("stepped", stepped, noise=[NoiseEvent("step<10%", 300, 600, 1.3)])
    lines, kinds = errors([healthy, noisy], detect_many([healthy.times, noisy.times], "bocd-v"),
                          "confirmed", events=False)
    assert len(lines) == 1 and lines[0][0].startswith("stepped false alarm at ")
    assert kinds == {("step<10%",): 1}

    slow = _flat(600, 3)
    slow[300:400] *= 1.5
    found = Trace("found", slow, episodes=[Episode(300, 400, 1.5, 300)], t0=1.0)
    missed = Trace("missed", _flat(600, 4), episodes=[Episode(300, 400, 1.5, 300)], t0=1.0)
    lines, kinds = errors([found, missed], detect_many([found.times, missed.times], "bocd-v"),
                          "confirmed", events=True)
    assert [x[0].split(" at ")[0] for x in lines] == ["missed missed 1.50x [300,400)"]
    assert kinds == {(): 1}
