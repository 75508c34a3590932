"""Hang diagnosis on a small TP x DP job played in program order until it hangs."""

import numpy as np

from greyhound.core.hang_diagnosis import CommCounters, LastRecords, diagnose_hang

S = 1_000_000_000
DP_BASE = 100


def _play(tp=4, dp=4, iters=6, stop=(), wrong=(), dead=(), dead_blocks_all=False, keep=2):
    """Run every rank's program [TP, TP, DP] x iters; return counters, last records and now.

    stop: (rank, step) never entered; wrong: (rank, step) entered as AllGather instead of
    AllReduce; dead: (rank, step) entered but never left (for everyone when dead_blocks_all).
    A collective instance completes when all members entered it with the same op.
    """
    n = tp * dp
    row, col = np.arange(n) // tp, np.arange(n) % tp
    program = [[row[r] if k % 3 < 2 else DP_BASE + col[r] for k in range(3 * iters)] for r in range(n)]
    members = {}
    for r in range(n):
        for c in set(int(x) for x in program[r]):
            members.setdefault(c, []).append(r)
    entered = {(c, r): 0 for c, ms in members.items() for r in ms}
    completed = dict(entered)
    records = {key: [] for key in entered}
    pos, waiting = [0] * n, [False] * n
    clock = 0
    progress = True
    while progress:
        progress = False
        for r in range(n):
            if waiting[r] or pos[r] == len(program[r]) or (r, pos[r]) in stop:
                continue
            c = int(program[r][pos[r]])
            op = "AllGather" if (r, pos[r]) in wrong else "AllReduce"
            clock += 1000
            records[(c, r)].append([entered[(c, r)], op, 1 << 20, 7, clock, -1])
            entered[(c, r)] += 1
            waiting[r] = True
            progress = True
        for c, ms in members.items():
            seq = min(completed[(c, r)] for r in ms)
            if any(entered[(c, r)] <= seq for r in ms):
                continue
            recs = [next(x for x in records[(c, r)] if x[0] == seq) for r in ms]
            if len({x[1] for x in recs}) > 1:
                continue
            dead_here = [r for r in ms if (r, pos[r]) in dead and completed[(c, r)] == seq]
            if dead_here and dead_blocks_all:
                continue
            clock += 1000
            for r, x in zip(ms, recs, strict=True):
                if r in dead_here or completed[(c, r)] > seq:
                    continue
                x[5] = clock
                completed[(c, r)] += 1
                waiting[r] = False
                pos[r] += 1
                progress = True
    keys = sorted(entered)
    dead_ranks = {r for r, _ in dead}
    prog = [10 * completed[k] + (1 if k[1] in dead_ranks else 5) * (entered[k] > completed[k]) for k in keys]
    counters = CommCounters(
        np.array([k[0] for k in keys]),
        np.array([k[1] for k in keys]),
        np.array([entered[k] for k in keys]),
        np.array([completed[k] for k in keys]),
        np.array(prog),
    )
    rows = [(k[0], k[1], *x) for k in keys for x in records[k][-keep:]]
    comm, rank, seq, op, count, dtype, enter, exit_ = map(np.array, zip(*rows, strict=True))
    last = LastRecords(comm, rank, seq, op, count, dtype, enter, exit_)
    return counters, last, clock + 60 * S


def _kinds(diags):
    return sorted({d.kind for d in diags})


def test_healthy_finished_job_has_no_hang():
    counters, last, now = _play()
    assert diagnose_hang(counters, last, now_ns=now) == []


def test_collective_in_progress_is_not_a_hang_yet():
    counters, last, now = _play(stop={(5, 7)})
    assert diagnose_hang(counters, last, now_ns=now - 59 * S, stall_ns=60 * S) == []


def test_not_entered_names_the_rank_op_and_sequence():
    counters, last, now = _play(stop={(6, 8)})  # rank 6 never reaches its 3rd DP all-reduce
    diags = diagnose_hang(counters, last, now_ns=now)
    assert _kinds(diags) == ["hang_not_entered"]
    assert all(d.ranks == [6] for d in diags)
    dp = [d for d in diags if d.comm_id == DP_BASE + 2]
    assert len(dp) == 1 and dp[0].seq == 2 and dp[0].op == "AllReduce"
    assert dp[0].evidence["never_reached_seq"] == 2 and dp[0].evidence["stalled_ns"] >= 60 * S
    assert len(dp[0].evidence["symptom_comms"]) >= 1  # the cascade was recognised and dropped


def test_inconsistent_names_the_odd_rank():
    counters, last, now = _play(wrong={(9, 4)})  # rank 9 calls AllGather at its 5th step (TP)
    diags = diagnose_hang(counters, last, now_ns=now)
    assert _kinds(diags) == ["hang_inconsistent"]
    (d,) = diags
    assert d.ranks == [9] and d.comm_id == 2 and d.seq == 3 and d.op == "AllReduce"
    assert d.evidence["their_ops"] == ["AllGather"]


def test_hardware_names_the_rank_that_never_completes():
    counters, last, now = _play(dead={(3, 5)})
    diags = diagnose_hang(counters, last, now_ns=now)
    assert _kinds(diags) == ["hang_hardware"]
    assert all(d.ranks == [3] for d in diags)
    assert diags[0].comm_id == DP_BASE + 3 and diags[0].seq == 1


def test_hardware_with_everyone_pending_uses_progress_counters():
    counters, last, now = _play(dead={(10, 4)}, dead_blocks_all=True)
    diags = diagnose_hang(counters, last, now_ns=now)
    assert _kinds(diags) == ["hang_hardware"]
    (d,) = diags
    assert d.ranks == [10] and d.comm_id == 2 and d.evidence["localized"] == 1
    blind = CommCounters(counters.comm_id, counters.rank, counters.entered, counters.completed)
    (d,) = diagnose_hang(blind, last, now_ns=now)
    assert d.kind == "hang_hardware" and d.ranks == [8, 9, 10, 11] and d.evidence["localized"] == 0


def test_concurrent_roots_are_all_named():
    counters, last, now = _play(tp=4, dp=8, stop={(1, 5)}, wrong={(30, 5)})
    diags = diagnose_hang(counters, last, now_ns=now)
    named = {(d.kind, tuple(d.ranks)) for d in diags}
    assert ("hang_inconsistent", (30,)) in named
    assert ("hang_not_entered", (1,)) in named
    assert {r for d in diags for r in d.ranks} == {1, 30}


def test_empty_input():
    z = np.zeros(0)
    assert diagnose_hang(CommCounters(z, z, z, z), LastRecords(z, z, z, z, z, z, z, z), now_ns=0) == []


def test_random_single_faults_find_their_root():
    rng = np.random.default_rng(42)
    kinds = {"stop": "hang_not_entered", "wrong": "hang_inconsistent", "dead": "hang_hardware"}
    for _ in range(24):
        tp, dp = int(rng.choice([2, 4, 8])), int(rng.choice([2, 3, 4, 8]))
        rank, step = int(rng.integers(tp * dp)), int(rng.integers(1, 15))
        fault = str(rng.choice(list(kinds)))
        counters, last, now = _play(tp=tp, dp=dp, **{fault: {(rank, step)}})
        diags = diagnose_hang(counters, last, now_ns=now)
        assert diags, (tp, dp, fault, rank, step)
        assert {d.kind for d in diags} == {kinds[fault]}, (tp, dp, fault, rank, step, diags)
        assert {r for d in diags for r in d.ranks} == {rank}, (tp, dp, fault, rank, step, diags)


def _cascade(n=256, tp=8, root=43, root_waits=False):
    """Every TP group misses its member with root's TP index, who waits in the DP all-reduce
    that root never entered (unless root_waits: then nobody is idle, a cycle)."""
    ranks = np.arange(n)
    tp_comm, dp_comm = ranks // tp, DP_BASE + ranks % tp
    comm, rank = np.concatenate((tp_comm, dp_comm)), np.concatenate((ranks, ranks))
    entered = np.concatenate((np.full(n, 21), np.full(n, 10)))
    completed = np.concatenate((np.full(n, 20), np.full(n, 10)))
    lag = dp_comm == dp_comm[root]
    entered[:n][lag] = 20
    entered[n:][lag & ((ranks != root) | root_waits)] = 11
    exit_ = np.where(entered > completed, -1.0, 1.1 * S)
    counters = CommCounters(comm, rank, entered, completed)
    last = LastRecords(comm, rank, entered - 1, np.array(["AllReduce"] * 2 * n), np.full(2 * n, 1 << 20),
                       np.full(2 * n, 7), np.full(2 * n, 1.0 * S), exit_)
    return counters, last, 70 * S


def test_job_wide_cascade_names_only_the_root():
    diags = diagnose_hang(*_cascade()[:2], now_ns=_cascade()[2])
    assert {(d.kind, tuple(d.ranks)) for d in diags} == {("hang_not_entered", (43,))}
    # the 31 other TP groups were recognised as symptoms, in bulk
    assert len(diags[0].evidence["symptom_comms"]) >= 31


def test_cascade_without_an_idle_rank_reports_the_waiting_groups():
    counters, last, now = _cascade(root_waits=True)
    diags = diagnose_hang(counters, last, now_ns=now)
    # every member of root's DP all-reduce is inside it and none returns: without progress
    # counters that is all that can be said, and it is said as not localised
    assert [(d.kind, d.comm_id, len(d.ranks)) for d in diags] == [("hang_hardware", DP_BASE + 3, 32)]
    assert diags[0].evidence["localized"] == 0
