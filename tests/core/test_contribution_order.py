"""Row order is not evidence: the same profile in any order gives the same classification.

classify_slow takes a fast path when each rank's rows already arrive in time order and sorts
them otherwise; both must give the same gaps, contribution factors and culprits.
"""

import numpy as np

from greyhound.core.contribution import CollectiveObservation, classify_slow
from tests.core.test_contribution import DP_BASE, _job


def _permuted(obs: CollectiveObservation, order: np.ndarray) -> CollectiveObservation:
    return CollectiveObservation(
        obs.comm_id[order],
        obs.seq[order],
        obs.rank[order],
        obs.enter_ns[order],
        obs.exit_ns[order],
        obs.op[order],
        obs.nbytes[order],
        np.asarray(obs.algo)[order],
    )


def test_shuffled_rows_give_the_same_answer():
    obs = _job(11, tp=4, dp=8, slow_rank={5: 1.4}, dp_comm_slow={2: 1.6})
    ordered = classify_slow(obs)
    assert ordered.kind == "mixed_slow" and ordered.compute_ranks == [5]
    assert ordered.comm_ids == [DP_BASE + 2]
    rng = np.random.default_rng(12)
    for order in (rng.permutation(len(obs.rank)), np.arange(len(obs.rank))[::-1]):
        shuffled = classify_slow(_permuted(obs, order))
        assert shuffled.kind == ordered.kind
        assert shuffled.compute_ranks == ordered.compute_ranks
        assert shuffled.comm_ids == ordered.comm_ids
        assert np.array_equal(shuffled.rank_ids, ordered.rank_ids)
        assert np.allclose(shuffled.p, ordered.p, equal_nan=True)
        assert np.isclose(shuffled.evidence["late_threshold_ns"], ordered.evidence["late_threshold_ns"])


def test_single_row_per_rank_has_no_gap_and_no_culprit():
    z = np.zeros(4, np.int64)
    obs = CollectiveObservation(z, z, np.arange(4), np.arange(4) * 1e6, np.full(4, 9e6), z, z)
    s = classify_slow(obs)
    assert s.compute_ranks == [] and s.evidence["instances"] == 1
