"""Validation verdicts on synthetic GEMM and P2P timings (seeded noise)."""

import numpy as np
import pytest

from greyhound.core.verdict import combine_verdicts, judge_gemm, judge_links, judge_links_by_class

SIZES = [16, 32, 64]  # MB, each measured 3 times


def _gemm(n, slow, seed, factor=1.4):
    rng = np.random.default_rng(seed)
    t = 0.24 * (1 + rng.normal(0, 0.01, n))
    for g in slow:
        t[g] *= factor
    return {i: float(x) for i, x in enumerate(t)}


def _links(pairs, slow, seed, factor=1.5):
    rng = np.random.default_rng(seed)
    base = np.repeat(np.array(SIZES, dtype=float) * 1e6 / 40e9, 3)  # 40 GB/s links
    out = {}
    for pair in pairs:
        t = base * (1 + rng.normal(0, 0.02, base.size))
        if pair in slow:
            t *= factor
        out[pair] = t.tolist()
    return out


def test_gemm_names_the_throttled_gpus():
    v = judge_gemm(_gemm(8, [5], seed=1))
    assert v.slow_gpus == [5] and not v.transient
    assert v.evidence["slow_gpus"] == [5] and v.ratios[5] > 1.3
    v = judge_gemm(_gemm(16, [2, 11], seed=2, factor=3.6))  # paper: 0.87 s vs 0.24 s healthy
    assert sorted(v.slow_gpus) == [2, 11]
    assert v.slow_gpus[0] in (2, 11) and v.evidence["max_ratio"] > 3


def test_gemm_healthy_is_transient():
    for seed in range(10):
        v = judge_gemm(_gemm(32, [], seed=seed))
        assert v.slow_gpus == [] and v.transient


def test_gemm_baseline_catches_a_mostly_throttled_group():
    times = _gemm(4, [0, 1, 2], seed=3)
    assert judge_gemm(times).slow_gpus == []  # the median itself is throttled
    assert sorted(judge_gemm(times, baseline_s=0.24).slow_gpus) == [0, 1, 2]


def test_links_names_the_congested_link():
    ring = [(i, (i + 1) % 8) for i in range(8)]
    v = judge_links(_links(ring, {(3, 4)}, seed=4))
    assert v.slow_links == [(3, 4)] and not v.transient
    assert v.evidence["slow_links"] == [[3, 4]]
    assert v.evidence["tests_per_link"] == 9


def test_links_healthy_is_transient():
    ring = [(i, (i + 1) % 16) for i in range(16)]
    for seed in range(10):
        assert judge_links(_links(ring, set(), seed=seed)).transient


def test_one_delayed_test_does_not_make_a_healthy_link_slow():
    """On a busy host one P2P test of a healthy link can take ten times its time (the demo's 4
    ranks share 2 cores with the whole stack); a congested link is slow in every test."""
    ring = [(i, (i + 1) % 4) for i in range(4)]
    times = _links([*ring, (0, 2), (1, 3)], {(1, 2)}, seed=11, factor=4.0)
    times[(0, 1)][0] *= 10
    times[(0, 1)][4] *= 3
    v = judge_links(times)
    assert v.slow_links == [(1, 2)]
    assert 3.5 < v.ratios[(1, 2)] < 4.5 and v.ratios[(0, 1)] < 1.15


def test_links_need_comparable_sequences():
    with pytest.raises(ValueError):
        judge_links({(0, 1): [1.0, 2.0], (1, 0): [1.0]})


def test_combined_verdicts():
    gemm = judge_gemm(_gemm(8, [1], seed=5))
    links = judge_links(_links([(0, 1), (1, 2), (2, 0)], {(2, 0)}, seed=6))
    healthy_links = judge_links(_links([(0, 1), (1, 2), (2, 0)], set(), seed=7))
    healthy_gemm = judge_gemm(_gemm(8, [], seed=8))
    assert combine_verdicts(gemm, links).kind == "mixed_slow"
    assert combine_verdicts(gemm, healthy_links).kind == "compute_slow"
    assert combine_verdicts(healthy_gemm, links).kind == "comm_slow"
    v = combine_verdicts(healthy_gemm, healthy_links)
    assert v.kind == "transient" and v.gpus == [] and v.links == []
    assert combine_verdicts(None, None).kind == "transient"
    assert v.evidence["gemm_checked"] == 1 and "p2p_max_ratio" in v.evidence


def test_links_compared_within_their_class_against_a_healthy_reference():
    """mixed-s16's check: a DP group over nodes 0 and 1 whose every network hop crosses the
    congested pair (4x), next to NVLink hops 40x faster. Pooled, nothing stands out; by class
    with a healthy group's network hops as reference, the eight congested hops do."""
    rng = np.random.default_rng(3)
    seq = np.array([1.0, 1, 1, 2, 2, 2, 4, 4, 4])

    def t(base):
        return [float(x) for x in base * seq * (1 + rng.normal(0, 0.01, len(seq)))]

    nv, net = 0.135e-3, 1.35e-3
    suspect_nv = {(0, 2): t(nv), (1, 3): t(nv), (4, 6): t(nv), (5, 7): t(nv)}
    suspect_net = {k: t(4 * net) for k in [(2, 4), (3, 5), (4, 0), (5, 1), (6, 0), (6, 2), (7, 1), (7, 3)]}
    ref = {(8, 10): t(nv), (10, 12): t(net), (12, 14): t(nv), (14, 8): t(net)}
    times = {**suspect_nv, **suspect_net, **ref}
    cls = {k: "nvlink" if k[0] // 4 == k[1] // 4 else "network" for k in times}
    pooled = judge_links({**suspect_nv, **suspect_net})
    assert pooled.slow_links == []  # the congested hops are the median: the old blind spot
    v = judge_links_by_class(times, cls, reference=list(ref))
    assert sorted(v.slow_links) == sorted(suspect_net)
    assert all(3.5 < v.ratios[k] < 4.5 for k in suspect_net)
    assert v.evidence["reference_links"] == 4 and v.evidence["links_tested"] == 12
    # without a reference, a class is judged on its own median (nothing to say here)
    assert judge_links_by_class(times, cls).slow_links == []
    healthy = {**suspect_nv, **{k: t(net) for k in suspect_net}, **ref}
    assert judge_links_by_class(healthy, cls, reference=list(ref)).slow_links == []
