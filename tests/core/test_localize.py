"""Comparable clusters: the degraded group is found, ring and tree stay apart, healthy stays quiet."""

import numpy as np

from greyhound.core.localize import GroupTimings, combine_codes, find_slow_groups, group_median


def _timings(seed, *, n_groups=8, calls=20, slow=None, tree_groups=(), jitter=0.03):
    """DP all-reduce groups (1 GiB) and TP all-reduce groups (64 MiB) with noisy durations."""
    slow = slow or {}
    rng = np.random.default_rng(seed)
    gid, op, nbytes, algo, dur = [], [], [], [], []
    for g in range(n_groups):
        tree = g in tree_groups
        for kind, size, base in (("AllReduce", 1 << 30, 80e6), ("AllGather", 64 << 20, 5e6)):
            t = base * (1.3 if tree else 1.0) * slow.get(g, 1.0)
            gid += [g] * calls
            op += [kind] * calls
            nbytes += [size] * calls
            algo += ["tree" if tree else "ring"] * calls
            dur += list(t * (1 + rng.normal(0, jitter, calls)))
    return GroupTimings(np.array(gid), np.array(op), np.array(nbytes), np.array(algo), np.array(dur))


def test_group_median_matches_numpy():
    rng = np.random.default_rng(0)
    g = rng.integers(0, 7, 500)
    v = rng.normal(size=500)
    med = group_median(g, v, 8)
    for k in range(7):
        assert np.isclose(med[k], np.median(v[g == k]))
    assert np.isnan(med[7])


def test_combine_codes_distinct_rows():
    a = np.array([0, 0, 1, 1, 0])
    b = np.array([5, 6, 5, 5, 5])
    code, first = combine_codes(a, b)
    assert len(first) == 3
    assert code[0] == code[4] == code[first[code[0]]]
    assert len({code[0], code[1], code[2]}) == 3


def test_degraded_group_is_flagged_with_evidence():
    slow = find_slow_groups(_timings(1, slow={5: 1.25}))
    assert [s.group_id for s in slow] == [5]
    s = slow[0]
    assert s.ratio > 1.15 and s.evidence["clusters_flagged"] == 2
    assert s.evidence["cluster_groups"] == 8 and s.evidence["threshold"] == 0.10


def test_several_degraded_groups_ordered_by_ratio():
    slow = find_slow_groups(_timings(2, slow={1: 1.2, 6: 1.6}))
    assert [s.group_id for s in slow] == [6, 1]


def test_ring_and_tree_are_separate_clusters():
    data = _timings(3, tree_groups=(0, 1, 2))  # tree runs are 30% slower by nature
    assert find_slow_groups(data) == []
    slow = find_slow_groups(_timings(3, tree_groups=(0, 1, 2), slow={1: 1.3}))
    assert [s.group_id for s in slow] == [1] and slow[0].algo == "tree"


def test_no_false_group_on_noisy_healthy_runs():
    for seed in range(20):
        assert find_slow_groups(_timings(100 + seed, jitter=0.03)) == []


def test_lone_group_has_nothing_to_compare_with():
    assert find_slow_groups(_timings(4, n_groups=1, slow={0: 3.0})) == []
    empty = GroupTimings(np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0))
    assert find_slow_groups(empty) == []


def test_localisation_cores_import_without_service_packages():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "for name in ('nats', 'sqlalchemy', 'fastapi'):\n"
        "    sys.modules[name] = None\n"
        "import greyhound.core.localize, greyhound.core.contribution, greyhound.core.hang_diagnosis\n"
        "import greyhound.core.p2p_rounds, greyhound.core.verdict\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
