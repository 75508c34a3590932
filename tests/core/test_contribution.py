"""Contribution factor on a small synthetic TP x DP job: compute, communication, mixed, healthy."""

import numpy as np

from greyhound.core.contribution import CollectiveObservation, classify_slow

MS = 1e6
DP_BASE = 10_000  # comm ids of DP groups start here


def _job(
    seed,
    *,
    tp=4,
    dp=8,
    iters=12,
    slow_rank=None,
    dp_comm_slow=None,
    tp_comm_slow=None,
    jitter_ms=1.0,
    skew_ms=0.0,
    tree_cols=(),
):
    """Arrival and completion times of TP and DP all-reduces in a synchronous TP x DP job.

    Rank r = row * tp + col: row r // tp is its TP group, column r % tp its DP group. Each rank
    computes (slowed by `slow_rank` factors), enters its TP all-reduce, which completes a fixed
    time after its last member arrives, computes again, then the DP all-reduce likewise.
    """
    slow_rank = slow_rank or {}
    dp_comm_slow = dp_comm_slow or {}
    tp_comm_slow = tp_comm_slow or {}
    rng = np.random.default_rng(seed)
    n = tp * dp
    ranks = np.arange(n)
    factor = np.ones(n)
    for r, f in slow_rank.items():
        factor[r] = f
    skew = rng.normal(0, skew_ms * MS, n)
    tp_time = np.array([2 * MS * tp_comm_slow.get(g, 1.0) for g in range(dp)])
    dp_base = np.array([60 * MS * (1.3 if c in tree_cols else 1.0) for c in range(tp)])
    dp_time = dp_base * np.array([dp_comm_slow.get(c, 1.0) for c in range(tp)])
    t = np.zeros(n)
    rows = []

    def collective(comm, seq, size, algo, group_of, span):
        enter = t.copy()
        done = np.zeros(n)
        for g in np.unique(group_of):
            members = group_of == g
            done[members] = enter[members].max() + span[g]
        exit_ = done + rng.uniform(0, 0.02 * MS, n)
        for r in ranks:
            rows.append((comm[r], seq, r, enter[r] + skew[r], exit_[r] + skew[r], size, algo[r]))
        return exit_

    row_of, col_of = ranks // tp, ranks % tp
    algo_dp = np.array(["tree" if c in tree_cols else "ring" for c in col_of])
    for it in range(iters):
        for half in range(2):
            t = t + 40 * MS * factor + rng.normal(0, jitter_ms * MS, n).clip(-3 * MS, None)
            t = collective(row_of, 2 * it + half, 32 << 20, np.full(n, "ring"), row_of, tp_time)
        t = t + 20 * MS * factor + rng.normal(0, jitter_ms * MS, n).clip(-3 * MS, None)
        t = collective(DP_BASE + col_of, it, 1 << 30, algo_dp, col_of, dp_time)
    comm, seq, rank, enter, exit_, size, algo = map(np.array, zip(*rows, strict=True))
    op = np.where(size == (1 << 30), "AllReduce", "ReduceScatter")
    return CollectiveObservation(comm, seq, rank, enter, exit_, op, size, algo)


def test_compute_straggler_is_named_not_its_victims():
    s = classify_slow(_job(1, slow_rank={13: 1.3}))
    assert s.kind == "compute_slow"
    assert s.compute_ranks == [13] and s.ranks == [13]
    assert s.comm_ids == []
    p = dict(zip(s.rank_ids.tolist(), s.p.tolist(), strict=True))
    assert p[13] > 0.9
    assert s.evidence["compute_p"][0] > 0.9


def test_congested_dp_group_is_communication():
    s = classify_slow(_job(2, dp_comm_slow={2: 1.5}))
    assert s.kind == "comm_slow"
    assert s.comm_ids == [DP_BASE + 2] and s.compute_ranks == []
    assert s.ranks == [r for r in range(32) if r % 4 == 2]
    assert s.evidence["comm_ratio"][0] > 1.4
    p = dict(zip(s.rank_ids.tolist(), s.p.tolist(), strict=True))
    assert p[2] < 0.2


def test_slow_tp_group_explains_late_arrivals_at_dp():
    s = classify_slow(_job(3, tp_comm_slow={5: 4.0}))
    assert s.kind == "comm_slow"
    assert s.comm_ids == [5] and s.compute_ranks == []


def test_mixed_straggler_and_congestion():
    s = classify_slow(_job(4, slow_rank={6: 1.25}, dp_comm_slow={1: 1.4}))
    assert s.kind == "mixed_slow"
    assert s.compute_ranks == [6] and s.comm_ids == [DP_BASE + 1]
    assert 0.0 < s.evidence["job_p"] < 1.0


def test_several_concurrent_stragglers():
    s = classify_slow(_job(5, slow_rank={0: 1.2, 17: 1.4, 30: 1.3}))
    assert s.kind == "compute_slow" and s.compute_ranks == [0, 17, 30]


def test_two_stragglers_in_one_tp_group():
    s = classify_slow(_job(6, slow_rank={8: 1.3, 9: 1.2}))
    assert s.kind == "compute_slow" and s.compute_ranks == [8, 9]


def test_clock_skew_between_ranks_does_not_matter():
    obs = _job(7, slow_rank={21: 1.3}, dp_comm_slow={3: 1.5}, skew_ms=30.0)
    s = classify_slow(obs)
    assert s.kind == "mixed_slow"
    assert s.compute_ranks == [21] and s.comm_ids == [DP_BASE + 3]
    assert abs(s.evidence["comm_time_ns"][0] - 90 * MS) < 0.1 * MS
    assert abs(s.evidence["comm_baseline_ns"][0] - 60 * MS) < 0.1 * MS


def test_ring_and_tree_groups_compared_apart():
    s = classify_slow(_job(8, tree_cols=(0, 1)))
    assert s.kind == "none"
    s = classify_slow(_job(8, tree_cols=(0, 1), dp_comm_slow={0: 1.5}))
    assert s.kind == "comm_slow" and s.comm_ids == [DP_BASE]


def test_healthy_noisy_runs_name_nobody():
    for seed in range(12):
        s = classify_slow(_job(100 + seed, jitter_ms=2.0, skew_ms=5.0))
        assert s.kind == "none", (seed, s.evidence)
        assert s.ranks == []


def test_one_gc_pause_is_not_a_straggler():
    obs = _job(9)
    enter = obs.enter_ns.copy()
    hit = (obs.rank == 11) & (obs.comm_id == DP_BASE + 3) & (obs.seq == 4)
    enter[hit] += 150 * MS
    obs = CollectiveObservation(
        obs.comm_id, obs.seq, obs.rank, enter, obs.exit_ns, obs.op, obs.nbytes, obs.algo
    )
    assert classify_slow(obs).kind == "none"


def test_explicit_and_dynamic_baselines():
    # a single DP group cannot be compared with peers: the baseline must come from history
    obs = _job(10, tp=1, dp=4, dp_comm_slow={0: 1.5})
    assert classify_slow(obs).kind == "none"
    s = classify_slow(obs, baseline_ns={DP_BASE: 60 * MS})
    assert s.kind == "comm_slow" and s.comm_ids == [DP_BASE]
    assert s.evidence["comm_baseline_ns"] == [60 * MS]


def test_empty_observation():
    z = np.zeros(0)
    s = classify_slow(CollectiveObservation(z, z, z, z, z, z, z))
    assert s.kind == "none" and s.ranks == []


def test_random_faults_name_exactly_their_culprits():
    rng = np.random.default_rng(2024)
    for _ in range(30):
        tp, dp = int(rng.choice([2, 4, 8])), int(rng.choice([3, 4, 8]))
        kind = str(rng.choice(["compute", "two_compute", "dp_comm", "tp_comm", "mixed", "healthy"]))
        slow_rank, dp_slow, tp_slow = {}, {}, {}
        if kind in ("compute", "two_compute", "mixed"):
            for r in rng.choice(tp * dp, 2 if kind == "two_compute" else 1, replace=False):
                slow_rank[int(r)] = float(rng.uniform(1.15, 1.6))
        if kind in ("dp_comm", "mixed"):
            dp_slow[int(rng.integers(tp))] = float(rng.uniform(1.3, 2.0))
        if kind == "tp_comm":
            tp_slow[int(rng.integers(dp))] = float(rng.uniform(2.0, 5.0))
        obs = _job(
            int(rng.integers(1 << 30)),
            tp=tp,
            dp=dp,
            slow_rank=slow_rank,
            dp_comm_slow=dp_slow,
            tp_comm_slow=tp_slow,
            jitter_ms=float(rng.uniform(0.5, 2.0)),
            skew_ms=10.0,
        )
        s = classify_slow(obs)
        case = (kind, tp, dp, slow_rank, dp_slow, tp_slow)
        assert s.compute_ranks == sorted(slow_rank), case
        assert s.comm_ids == sorted([DP_BASE + c for c in dp_slow] + list(tp_slow)), case
