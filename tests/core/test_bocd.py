import json

import numpy as np

from greyhound.core.bocd import BocdBatch, BocdVBatch


def _series(seed: int, n: int = 400, step_at: int = 200, factor: float = 1.3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = 0.4 * np.exp(rng.normal(0.0, 0.02, n))
    x[step_at:] *= factor
    return x


def test_posterior_is_normalised_and_moves_to_a_new_run_after_a_step():
    core = BocdBatch(1)
    x = np.log(_series(1, factor=2.0))
    sigma = np.array([0.02])
    for t, v in enumerate(x):
        logp = core.step(np.array([v]), np.array([x[0]]), sigma)
        assert abs(np.exp(logp).sum() - 1.0) < 1e-9
        if t == 204:
            # Five points into the new level the MAP run starts at the step.
            assert int(logp[0].argmax()) == 4


def test_batched_streams_match_single_streams():
    series = [_series(s, factor=f) for s, f in ((2, 1.2), (3, 1.0), (4, 2.5))]
    batch = BocdVBatch(3)
    singles = [BocdVBatch(1) for _ in series]
    for t in range(len(series[0])):
        got = batch.update_many([s[t] for s in series])
        for j, s in enumerate(series):
            assert got[j] == singles[j].update_many([s[t]])[0]


def test_nan_skips_a_stream_without_touching_it():
    a = _series(5)
    b = BocdVBatch(2)
    ref = BocdVBatch(1)
    for t, v in enumerate(a):
        other = np.nan if t % 3 == 0 else 1.0
        assert b.update_many([v, other])[0] == ref.update_many([v])[0]
    assert int(b.core.seen[1]) == len(a) - len(range(0, len(a), 3))


def test_state_round_trip_through_json_continues_identically():
    x = _series(6, factor=1.5)
    a = BocdVBatch(1)
    for v in x[:150]:
        a.update_many([v])
    b = BocdVBatch.from_state(json.loads(json.dumps(a.state_dict(), allow_nan=False)))
    for v in x[150:]:
        assert a.update_many([v]) == b.update_many([v])
