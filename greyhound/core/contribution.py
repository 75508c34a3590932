"""CCL-D's contribution factor: is a slow job slow in compute, in communication, or both, and where.

Synchronous training hides a compute straggler inside the collectives: every rank waits for it in
NCCL, so per-rank durations look alike. What gives it away is *when each rank arrives* at a
collective: when its GPU reaches it (NCCL calls are asynchronous, so the host's entry into the
call says nothing; the callers pass GPU start and end times wherever the hook timed the call).
Arrival alone still blames victims, because delay propagates: ranks that waited for a straggler
in their TP group, or sat in a slow all-reduce, reach their next collective late too. So a rank's
own delay is its *gap*, the time from the completion of its previous collective to its arrival at
this one (same clock, so no clock synchronisation is needed), compared with the gaps of the other
members of the same collective instance. Each instance (comm, seq) also has a communication time
C = completion - last arrival, the collective itself once everyone is there; it is the smallest
time any rank spends inside it, since the last to arrive waits for no one. C is compared with a
healthy baseline: an explicit one from before the slowdown, the median of
comparable communicators (same op, bytes and algorithm; ring and tree apart), and CCL-D's dynamic
baseline from the first rounds, whichever is lowest. A rank's contribution factor is
P = own delay / (own delay + excess communication time of its collectives): P -> 1 names a compute
bottleneck, P -> 0 a communication one; ranks with both are the mixed case.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from greyhound.core.arrays import FloatArray, IntArray
from greyhound.core.localize import (
    Evidence,
    codes,
    combine_codes,
    combine_dense,
    group_median,
    group_quantile,
    order_by_code,
    order_within_groups,
)

SlowKind = Literal["compute_slow", "comm_slow", "mixed_slow", "none"]


@dataclass(frozen=True, slots=True, eq=False)
class CollectiveObservation:
    """One element per rank per collective instance, as the hook records it while profiling.

    ``enter_ns``/``exit_ns`` are the rank's arrival at the call and its completion (GPU start and
    end where timed). Times are nanoseconds on each rank's own clock: ranks' clocks may be offset
    from each other, since only differences on one rank are used. `algo` defaults to one
    algorithm for all. ``gap_known`` is False where the rank's previous call is missing from the
    observation (its timing was dropped), so the gap before this one would span it: such a gap
    is not used; default all True.
    """

    comm_id: IntArray
    seq: IntArray
    rank: IntArray
    enter_ns: FloatArray
    exit_ns: FloatArray
    op: NDArray[Any]
    nbytes: IntArray
    algo: NDArray[Any] | None = None
    gap_known: NDArray[np.bool_] | None = None

    def __post_init__(self) -> None:
        for name in ("comm_id", "seq", "rank", "nbytes"):
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=np.int64))
        for name in ("enter_ns", "exit_ns"):
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=np.float64))
        object.__setattr__(self, "op", np.asarray(self.op))
        algo = np.zeros(len(self.comm_id), np.int64) if self.algo is None else self.algo
        object.__setattr__(self, "algo", np.asarray(algo))
        n = len(self.comm_id)
        known = np.ones(n, bool) if self.gap_known is None else self.gap_known
        object.__setattr__(self, "gap_known", np.asarray(known, dtype=bool))
        arrays = (self.seq, self.rank, self.enter_ns, self.exit_ns, self.op, self.nbytes, algo,
                  known)
        if any(len(a) != n for a in arrays):
            raise ValueError("CollectiveObservation arrays must have equal lengths")


@dataclass(frozen=True, slots=True, eq=False)
class SlowSuspicion:
    kind: SlowKind
    ranks: list[int]
    compute_ranks: list[int]
    comm_ids: list[int]
    rank_ids: IntArray  # every observed rank, with its contribution factor below
    p: FloatArray  # NaN where a rank neither waited nor was waited for
    evidence: Evidence = field(default_factory=dict)


def classify_slow(
    obs: CollectiveObservation,
    *,
    baseline_ns: Mapping[int, float] | None = None,
    comm_threshold: float = 0.10,
    min_excess_ns: float = 100_000.0,
    min_late_ns: float = 2_000_000.0,
    jitter_k: float = 4.0,
    on_time_quantile: float = 0.25,
    min_late_share: float = 0.3,
    min_late_rounds: int = 2,
    baseline_rounds: int = 0,
) -> SlowSuspicion:
    """Classify a slowdown as compute, communication or mixed, naming ranks and communicators.

    A rank is late at an instance when its gap exceeds the on-time gap (the `on_time_quantile` of
    its peers' gaps) by more than max(min_late_ns, jitter_k x the robust spread of each rank's
    delay over time, which a steady straggler does not inflate). It is a compute culprit when
    late at `min_late_share` (and at least `min_late_rounds`) of one communicator's instances (so
    one GC pause is not a straggler, and back-to-back collectives where it cannot be late do not
    hide one). A communicator is slow when
    its median C exceeds the baseline by `comm_threshold` and by `min_excess_ns`.
    """
    n_rows = len(obs.comm_id)
    if n_rows == 0:
        empty = np.zeros(0, np.int64)
        return SlowSuspicion("none", [], [], [], empty, np.zeros(0), {"observations": 0})
    comm_values, comm_code = codes(obs.comm_id)
    rank_values, rank_code = codes(obs.rank)
    n_comms, n_ranks = len(comm_values), len(rank_values)
    seq_code = codes(obs.seq)[1]
    inst, inst_first = combine_dense((comm_code, seq_code), (n_comms, int(seq_code.max()) + 1))
    n_inst = len(inst_first)

    # --- communication: C per instance, per-communicator median against its healthy baseline.
    # The last rank to arrive spends exactly C inside the collective, and every rank measures
    # its own time inside on its own clock: C is the smallest in-collective time, skew-free.
    comm_time = np.full(n_inst, np.inf)
    np.minimum.at(comm_time, inst, np.maximum(obs.exit_ns - obs.enter_ns, 0.0))
    inst_comm = comm_code[inst_first]
    early = _position_in_group(inst_comm, obs.seq[inst_first]) < baseline_rounds
    comm_rounds = np.bincount(inst_comm, minlength=n_comms)
    in_window = ~early | (comm_rounds[inst_comm] <= baseline_rounds)
    comm_c = group_median(inst_comm[in_window], comm_time[in_window], n_comms)
    baseline = _comm_baseline(obs, comm_values, inst_comm, inst_first, comm_c, baseline_ns)
    if baseline_rounds > 0:
        dynamic = group_median(inst_comm[early], comm_time[early], n_comms)
        dynamic[comm_rounds <= baseline_rounds] = np.nan
        baseline = np.fmin(baseline, dynamic)
    excess = comm_c - baseline
    comm_slow = (comm_c > baseline * (1.0 + comm_threshold)) & (excess > min_excess_ns)
    inst_excess = np.maximum(comm_time - baseline[inst_comm], 0.0)

    # --- compute: each rank's gap since its previous collective, against its peers' gaps. The
    # reference is the instance's lower quartile (the shorter gap in a pair): stragglers cannot
    # drag it up unless they are most of the group. Jitter is each rank's own spread over time.
    gap = _gap_since_previous(rank_code, n_ranks, obs.enter_ns, obs.exit_ns)
    gap[~np.asarray(obs.gap_known)] = np.nan
    valid = ~np.isnan(gap)
    ref = group_quantile(inst[valid], gap[valid], n_inst, on_time_quantile)
    delay = np.where(valid, gap - ref[inst], 0.0)
    delay = np.nan_to_num(delay, nan=0.0)
    pair, pair_first = combine_dense((comm_code, rank_code), (n_comms, n_ranks))
    n_pairs = len(pair_first)
    # counts of sparse row sets come from their indices: a bincount weighted by a mask is a
    # float pass over every row
    gapless = np.flatnonzero(~valid)  # first rows of each rank, and rows after a missing call
    pair_rows = np.bincount(pair, minlength=n_pairs) - np.bincount(pair[gapless], minlength=n_pairs)
    pair_rounds = pair_rows.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        typical = np.bincount(pair, weights=delay, minlength=n_pairs) / pair_rounds
        # residuals around the mean of k values shrink by sqrt((k-1)/k): undo that
        widen = np.where(pair_rounds > 1, np.sqrt(pair_rounds / (pair_rounds - 1)), np.nan)
    residual = np.abs(delay - typical[pair]) * widen[pair]
    spread = residual[valid & ~np.isnan(residual)]
    jitter = 1.4826 * float(np.median(spread)) if len(spread) else 0.0
    late_thr = max(min_late_ns, jitter_k * jitter)
    late_rows = np.flatnonzero(valid & (delay > late_thr))
    pair_late = np.bincount(pair[late_rows], minlength=n_pairs).astype(np.float64)
    pair_late_ns = np.bincount(pair[late_rows], weights=delay[late_rows], minlength=n_pairs)
    flagged = (pair_late >= min_late_rounds) & (pair_late >= min_late_share * pair_rounds)
    pair_rank = rank_code[pair_first]
    culprit = np.bincount(pair_rank[flagged], minlength=n_ranks) > 0

    # --- contribution factor per rank
    own = np.bincount(rank_code, weights=np.maximum(delay, 0.0), minlength=n_ranks)
    comm_part = np.bincount(rank_code, weights=inst_excess[inst], minlength=n_ranks)
    denom = own + comm_part
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.where(denom > 0, own / denom, np.nan)

    compute_ranks = [int(r) for r in rank_values[culprit]]
    slow_comms = np.flatnonzero(comm_slow)
    comm_ids = [int(c) for c in comm_values[slow_comms]]
    comm_ranks = _any_per(rank_code[comm_slow[comm_code]], n_ranks)
    ranks = sorted(set(compute_ranks) | {int(r) for r in rank_values[comm_ranks]})
    kind: SlowKind
    if compute_ranks and comm_ids:
        kind = "mixed_slow"
    elif compute_ranks:
        kind = "compute_slow"
    elif comm_ids:
        kind = "comm_slow"
    else:
        kind = "none"

    culprit_idx = np.flatnonzero(culprit)
    total_own = float(np.maximum(delay[late_rows], 0.0).sum())
    total_excess = float(inst_excess[in_window].sum())
    evidence: Evidence = {
        "observations": n_rows,
        "instances": n_inst,
        "ranks_observed": n_ranks,
        "comms_observed": n_comms,
        "late_threshold_ns": float(late_thr),
        "gap_jitter_ns": jitter,
        "job_p": total_own / (total_own + total_excess) if total_own + total_excess > 0 else 0.0,
        "compute_ranks": list(compute_ranks),
        "compute_p": [float(p[i]) for i in culprit_idx],
        "compute_late_share": _per_rank_max(
            pair_rank[flagged], pair_late[flagged] / pair_rounds[flagged], culprit_idx
        ),
        "compute_mean_delay_ns": _per_rank_max(
            pair_rank[flagged], pair_late_ns[flagged] / pair_late[flagged], culprit_idx
        ),
        "slow_comms": list(comm_ids),
        "comm_time_ns": [float(comm_c[i]) for i in slow_comms],
        "comm_baseline_ns": [float(baseline[i]) for i in slow_comms],
        "comm_ratio": [float(comm_c[i] / baseline[i]) for i in slow_comms],
        "comm_threshold": comm_threshold,
    }
    return SlowSuspicion(kind, ranks, compute_ranks, comm_ids, rank_values, p, evidence)


def _gap_since_previous(rank: IntArray, n_ranks: int, enter: FloatArray, exit_: FloatArray) -> FloatArray:
    """Per row, time since the same rank's previous collective completed (NaN for its first).

    Collectives that overlap (an asynchronous all-reduce still running) give a gap of zero, the
    same for every peer, so they neither accuse nor excuse anyone. Rows usually arrive in time
    order per rank (each rank's hook appends), so a stable sort by rank alone is tried first.
    """
    order = order_by_code(rank, n_ranks)
    r, e = rank[order], enter[order]
    same = r[1:] == r[:-1]
    if bool(np.any(same & (e[1:] < e[:-1]))):
        order = order_within_groups(rank, enter, n_ranks)
        r, e = rank[order], enter[order]
        same = r[1:] == r[:-1]
    x = exit_[order]
    gap_sorted = np.full(len(order), np.nan)
    gap_sorted[1:] = np.where(same, np.maximum(e[1:] - x[:-1], 0.0), np.nan)
    gap = np.empty(len(order))
    gap[order] = gap_sorted
    return gap


def _comm_baseline(
    obs: CollectiveObservation,
    comm_values: IntArray,
    inst_comm: IntArray,
    inst_first: IntArray,
    comm_c: FloatArray,
    baseline_ns: Mapping[int, float] | None,
) -> FloatArray:
    """Lowest of the explicit baseline and the median of comparable communicators.

    A communicator's op, bytes and algorithm are those of its first row, found among the first
    rows of its instances.
    """
    n_comms = len(comm_values)
    first_row = np.full(n_comms, np.iinfo(np.int64).max, np.int64)
    np.minimum.at(first_row, inst_comm, inst_first)
    _, op_code = codes(obs.op[first_row])
    _, algo_code = codes(np.asarray(obs.algo)[first_row])
    cluster, cluster_first = combine_codes(op_code, obs.nbytes[first_row], algo_code)
    peers = group_median(cluster, comm_c, len(cluster_first))[cluster]
    if baseline_ns:
        given = np.array([baseline_ns.get(int(c), np.nan) for c in comm_values])
        return np.asarray(np.fmin(peers, given), dtype=np.float64)
    return peers


def _position_in_group(group: IntArray, order_key: IntArray) -> IntArray:
    """0-based position of each element within its group when ordered by `order_key`."""
    order = order_within_groups(group, order_key.astype(np.float64), int(group.max()) + 1)
    g = group[order]
    starts = np.flatnonzero(np.concatenate(([True], g[1:] != g[:-1])))
    run = np.repeat(starts, np.diff(np.concatenate((starts, [len(g)]))))
    pos = np.empty(len(group), np.int64)
    pos[order] = np.arange(len(g)) - run
    return pos


def _any_per(index: IntArray, n: int) -> NDArray[np.bool_]:
    return np.bincount(index, minlength=n) > 0


def _per_rank_max(rank_idx: IntArray, values: FloatArray, wanted: IntArray) -> list[object]:
    out = np.full(len(wanted), -np.inf)
    where = np.searchsorted(wanted, rank_idx)
    np.maximum.at(out, where, values)
    return [float(v) for v in out]
