#!/usr/bin/env python3
"""Analyzer localisation compute time from 1,024 to 65,536 ranks, ours vs a per-rank Python loop.

One localisation = classify_slow (a mixed slowdown: one compute straggler and one congested DP
group) + diagnose_hang (three concurrent hangs: a rank that never entered, an inconsistent op, a
rank that never completes) + find_slow_groups (one degraded DP group). The job is TP8 x PP4 x DP
(32 DP groups of N/32 ranks each, N/8 TP groups of 8), observed over a window of 3 iterations (TP then DP
all-reduce each). Target: <= 50 ms at 16,384 ranks (CCL-D: 146 ms). The naive reference makes
the same decisions with dicts and per-rank loops; its answers are checked against ours.
Separately, a job-wide hang cascade (every TP group stalled, one root) is diagnosed alone
(cascade_ms_by_ranks): the realistic shape of a hang at scale, with no naive counterpart (a
per-communicator rule names a symptom in every group).

The machine may be shared, so each size is timed over many repeats after a warm-up call: the
figure is the median wall time (ms_by_ranks), shown with the minimum and the median CPU time of
the calling thread, which waiting for a busy CPU does not inflate. The three calls are also timed
one by one at 16,384 ranks.
"""

from __future__ import annotations

import gc
import itertools
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from greyhound.core.contribution import CollectiveObservation, classify_slow
from greyhound.core.hang_diagnosis import CommCounters, LastRecords, diagnose_hang
from greyhound.core.localize import GroupTimings, find_slow_groups

MS = 1e6
TP, PP, ITERS = 8, 4, 3
DP_BASE = 1 << 20


def layout(n):
    ranks = np.arange(n)
    tp_comm = ranks // TP
    dp_comm = DP_BASE + (ranks % TP) + TP * ((ranks // TP) % PP)
    return ranks, tp_comm, dp_comm


def slow_job(n, seed, straggler, congested):
    rng = np.random.default_rng(seed)
    ranks, tp_comm, dp_comm = layout(n)
    factor = np.ones(n)
    factor[straggler] = 1.3
    dp_span = np.full(TP * PP, 60 * MS)
    dp_span[congested - DP_BASE] *= 1.5
    t = rng.normal(0, 5 * MS, n)
    cols = []
    for it in range(ITERS):
        for comm, span, size in ((tp_comm, None, 32 << 20), (dp_comm, dp_span, 1 << 30)):
            t = t + 30 * MS * factor + rng.normal(0, 1 * MS, n)
            if span is None:
                done = t.reshape(-1, TP).max(axis=1).repeat(TP) + 2 * MS
            else:
                grid = t.reshape(-1, PP, TP).max(axis=0).reshape(-1)
                done = grid[comm - DP_BASE] + span[comm - DP_BASE]
            exit_ = done + rng.uniform(0, 0.02 * MS, n)
            cols.append((comm, np.full(n, it), ranks, t, exit_, np.full(n, size)))
            t = exit_
    comm, seq, rank, enter, exit_, size = (np.concatenate(c) for c in zip(*cols, strict=True))
    op = np.where(size == (1 << 30), 1, 0)  # op codes, as the hook records them
    return CollectiveObservation(comm, seq, rank, enter, exit_, op, size)


def hang_state(n, not_entered, inconsistent, hardware):
    ranks, tp_comm, dp_comm = layout(n)
    comm = np.concatenate((tp_comm, dp_comm))
    rank = np.concatenate((ranks, ranks))
    entered = np.concatenate((np.full(n, 20), np.full(n, 10)))
    completed = entered.copy()
    op = np.zeros(2 * n, np.int64)
    enter = np.full(2 * n, 1.0 * 10**9)
    exit_ = enter + 1e6
    g_ne, g_in = dp_comm[not_entered], dp_comm[inconsistent]
    stuck = ((comm == g_ne) & (rank != not_entered)) | (comm == g_in)
    entered[stuck] += 1
    exit_[stuck] = -1
    op[(comm == g_in) & (rank == inconsistent)] = 2
    hw = (comm == tp_comm[hardware]) & (rank == hardware)
    entered[comm == tp_comm[hardware]] += 1
    completed[(comm == tp_comm[hardware]) & ~hw] += 1
    exit_[hw] = -1
    counters = CommCounters(comm, rank, entered, completed)
    last = LastRecords(comm, rank, entered - 1, op, np.full(2 * n, 1 << 20), np.full(2 * n, 7), enter, exit_)
    return counters, last, 70 * 10**9


def cascade_state(n, root):
    """A job-wide hang in a TP8 x DP(n/8) job: ``root`` never entered its TP all-reduce; in
    every other TP group the member with root's TP index is missing too, because it already
    waits in the DP all-reduce that ``root`` never reached. All n/8 TP groups and root's DP group
    are stalled; the one cause is ``root``, everything else is a symptom to drop."""
    ranks = np.arange(n)
    tp_comm, dp_comm = ranks // TP, DP_BASE + ranks % TP
    comm = np.concatenate((tp_comm, dp_comm))
    rank = np.concatenate((ranks, ranks))
    entered = np.concatenate((np.full(n, 21), np.full(n, 10)))
    completed = np.concatenate((np.full(n, 20), np.full(n, 10)))
    lag = dp_comm == dp_comm[root]
    entered[:n][lag] = 20  # never entered the TP all-reduce ...
    entered[n:][lag & (ranks != root)] = 11  # ... waiting in the DP all-reduce, except root
    exit_ = np.where(entered > completed, -1.0, 1.1e9)
    counters = CommCounters(comm, rank, entered, completed)
    last = LastRecords(comm, rank, entered - 1, np.zeros(2 * n, np.int64), np.full(2 * n, 1 << 20),
                       np.full(2 * n, 7), np.full(2 * n, 1e9), exit_)
    return counters, last, 70 * 10**9


def group_timings(n, seed, degraded):
    rng = np.random.default_rng(seed)
    groups = np.arange(DP_BASE, DP_BASE + TP * PP).repeat(20)
    dur = 60 * MS * (1 + rng.normal(0, 0.02, groups.size))
    dur[groups == degraded] *= 1.3
    z = np.zeros(groups.size, np.int64)
    return GroupTimings(groups, z + 1, z + (1 << 30), z, dur)


def ours(slow, hang, groups):
    s = classify_slow(slow)
    h = diagnose_hang(*hang[:2], now_ns=hang[2])
    g = find_slow_groups(groups)
    hangs = sorted((d.kind, d.ranks[0]) for d in h)
    return s.kind, s.compute_ranks, s.comm_ids, hangs, [x.group_id for x in g]


def naive(slow, hang, groups):
    """The same decisions, one rank at a time, with dicts and Python's statistics module."""
    members = defaultdict(list)
    history = defaultdict(list)
    for i in range(len(slow.rank)):
        c, q, r = int(slow.comm_id[i]), int(slow.seq[i]), int(slow.rank[i])
        e, x = float(slow.enter_ns[i]), float(slow.exit_ns[i])
        members[(c, q)].append((r, e, x))
        history[r].append((e, x, c, q))
    gap = {}
    for r, calls in history.items():
        calls.sort()
        for prev, cur in itertools.pairwise(calls):
            gap[(cur[2], cur[3], r)] = max(cur[0] - prev[1], 0.0)
    comm_times = defaultdict(list)
    delay = defaultdict(list)
    for (c, q), rows in members.items():
        comm_times[c].append(min(x - e for _, e, x in rows))
        gaps = sorted(gap[(c, q, r)] for r, _, _ in rows if (c, q, r) in gap)
        if not gaps:
            continue
        pos = (len(gaps) - 1) * 0.25
        lo = int(pos)
        ref = gaps[lo] + (gaps[min(lo + 1, len(gaps) - 1)] - gaps[lo]) * (pos - lo)
        for r, _, _ in rows:
            if (c, q, r) in gap:
                delay[(c, r)].append(gap[(c, q, r)] - ref)
    spread = []
    for ds in delay.values():
        if len(ds) > 1:
            m = sum(ds) / len(ds)
            spread += [abs(d - m) * (len(ds) / (len(ds) - 1)) ** 0.5 for d in ds]
    thr = max(2 * MS, 4 * 1.4826 * statistics.median(spread))
    culprits = set()
    for (_, r), ds in delay.items():
        late = sum(d > thr for d in ds)
        if late >= 2 and late >= 0.3 * len(ds):
            culprits.add(r)
    culprits = sorted(culprits)
    comm_med = {c: statistics.median(v) for c, v in comm_times.items()}
    cluster = defaultdict(list)
    first = {}
    for i in range(len(slow.comm_id)):
        first.setdefault(int(slow.comm_id[i]), i)
    key = {c: (int(slow.op[i]), int(slow.nbytes[i])) for c, i in first.items()}
    for c, m in comm_med.items():
        cluster[key[c]].append(m)
    base = {k: statistics.median(v) for k, v in cluster.items()}
    slow_comms = sorted(c for c, m in comm_med.items() if m > 1.1 * base[key[c]] and m - base[key[c]] > 1e5)
    kind = {(True, True): "mixed_slow", (True, False): "compute_slow", (False, True): "comm_slow"}.get(
        (bool(culprits), bool(slow_comms)), "none"
    )

    counters, last, _ = hang
    rows_by_comm = defaultdict(list)
    for i in range(len(counters.comm_id)):
        rows_by_comm[int(counters.comm_id[i])].append(
            (int(counters.rank[i]), int(counters.entered[i]), int(counters.completed[i]))
        )
    rec = {}
    for i in range(len(last.comm_id)):
        rec[(int(last.comm_id[i]), int(last.rank[i]))] = (int(last.seq[i]), int(last.op[i]), last.exit_ns[i])
    hangs = []
    for c, rows in rows_by_comm.items():
        if not any(e > d for _, e, d in rows):
            continue
        top = max(e for _, e, _ in rows)
        lag = [r for r, e, d in rows if e < top]
        if lag:
            hangs.append(("hang_not_entered", lag[0]))
            continue
        ops = defaultdict(list)
        for r, _, _ in rows:
            _, op, _ = rec[(c, r)]
            ops[op].append(r)
        if len(ops) > 1:
            minority = min(ops.values(), key=len)
            hangs.append(("hang_inconsistent", minority[0]))
            continue
        pend = [r for r, e, d in rows if e > d]
        hangs.append(("hang_hardware", pend[0]))

    per_group = defaultdict(list)
    for g, d in zip(groups.group_id.tolist(), groups.duration_ns.tolist(), strict=True):
        per_group[g].append(d)
    gmed = {g: statistics.median(v) for g, v in per_group.items()}
    cmed = statistics.median(gmed.values())
    slow_groups = [g for g, m in gmed.items() if m > 1.1 * cmed]
    return kind, culprits, slow_comms, sorted(hangs), slow_groups


def timed(fn, *args, repeat, **kwargs):
    """Median and minimum wall ms, median thread-CPU ms, and the last answer, after a warm-up call."""
    out = fn(*args, **kwargs)
    gc.collect()
    wall, cpu = [], []
    for _ in range(repeat):
        c0, t0 = time.thread_time(), time.perf_counter()
        out = fn(*args, **kwargs)
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.thread_time() - c0) * 1e3)
    return statistics.median(wall), min(wall), statistics.median(cpu), out


def repeats_for(n):
    """About a second of timing per size, never fewer than 9 runs."""
    return max(9, min(61, 2_000_000 // n))


def main():
    sizes = [1024, 4096, 16384, 65536]
    ours_ms, min_ms, cpu_ms, naive_ms, correct, repeats, per_call = {}, {}, {}, {}, {}, {}, {}
    cascade_ms, cascade_ok = {}, {}
    print(
        f"{'ranks':>7} {'rows':>8} {'runs':>5} {'ours ms':>9} {'min ms':>8} {'cpu ms':>8} "
        f"{'naive ms':>9} {'speed-up':>9}  answers"
    )
    for n in sizes:
        straggler, congested = n // 3 + 5, DP_BASE + 13
        slow = slow_job(n, seed=n, straggler=straggler, congested=congested)
        hang = hang_state(n, not_entered=n // 2 + 1, inconsistent=n // 4 + 2, hardware=n - 3)
        groups = group_timings(n, seed=n, degraded=DP_BASE + 7)
        runs = repeats_for(n)
        ms, fastest, cpu, got = timed(ours, slow, hang, groups, repeat=runs)
        ref_ms, _, _, ref = timed(naive, slow, hang, groups, repeat=1)
        hangs = [
            ("hang_hardware", n - 3),
            ("hang_inconsistent", n // 4 + 2),
            ("hang_not_entered", n // 2 + 1),
        ]
        expected = ("mixed_slow", [straggler], [congested], sorted(hangs), [DP_BASE + 7])
        ok = got == expected and ref == expected
        key = str(n)
        ours_ms[key], min_ms[key], cpu_ms[key] = round(ms, 2), round(fastest, 2), round(cpu, 2)
        naive_ms[key], correct[key], repeats[key] = round(ref_ms, 1), ok, runs
        print(
            f"{n:>7} {len(slow.rank):>8} {runs:>5} {ms:>9.2f} {fastest:>8.2f} {cpu:>8.2f} "
            f"{ref_ms:>9.1f} {ref_ms / ms:>8.1f}x  {'correct' if ok else f'WRONG ours={got} naive={ref}'}"
        )
        root = 8 * (n // 16) + 3
        casc = cascade_state(n, root)
        c_ms, c_min, _, c_got = timed(diagnose_hang, *casc[:2], now_ns=casc[2], repeat=runs)
        c_ok = bool(c_got) and all(d.kind == "hang_not_entered" and d.ranks == [root] for d in c_got)
        cascade_ms[key], cascade_ok[key] = round(c_ms, 2), c_ok
        print(f"{'':>7} job-wide hang cascade ({n // TP + 1} stalled communicators): diagnose_hang "
              f"{c_ms:.2f} ms (min {c_min:.2f}), {'root named' if c_ok else f'WRONG {c_got[:3]}'}")
        if n == 16384:
            calls = (
                ("classify_slow", classify_slow, (slow,), {}),
                ("diagnose_hang", diagnose_hang, hang[:2], {"now_ns": hang[2]}),
                ("find_slow_groups", find_slow_groups, (groups,), {}),
            )
            for name, fn, args, kwargs in calls:
                call_ms, call_min, call_cpu, _ = timed(fn, *args, repeat=runs, **kwargs)
                per_call[name] = {
                    "ms": round(call_ms, 2),
                    "min_ms": round(call_min, 2),
                    "cpu_ms": round(call_cpu, 2),
                }
    print("\nat 16,384 ranks, one call at a time (median / min / cpu ms):")
    for name, t in per_call.items():
        print(f"  {name:<17} {t['ms']:>7.2f} {t['min_ms']:>7.2f} {t['cpu_ms']:>7.2f}")
    result = {
        "ms_by_ranks": ours_ms,
        "min_ms_by_ranks": min_ms,
        "cpu_ms_by_ranks": cpu_ms,
        "repeats_by_ranks": repeats,
        "naive_ms_by_ranks": naive_ms,
        "correct_by_ranks": correct,
        "per_call_ms_16384": per_call,
        "cascade_ms_by_ranks": cascade_ms,
        "cascade_correct_by_ranks": cascade_ok,
        "target_ms_16384": 50,
        "cclD_ms": 146,
        "meets_target": ours_ms["16384"] <= 50,
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
