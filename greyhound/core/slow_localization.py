"""From a profiling window of a slowed job to a classified suspicion: who, what kind, where.

The analyzer collects every call each rank completed for a couple of seconds and asks two
questions of them. CCL-D's contribution factor (``classify_slow``) names ranks that arrive late at
their collectives (compute) and communicators whose collectives themselves are slow against
comparable ones (communication). GREYHOUND's comparable clusters (``find_slow_groups``) flag
communicators more than 10% above the median of those moving the same data with the same op.

Two gaps remain that only the detection itself can close. A job with one communicator (or one
per op and size) has nothing to compare with; if no rank is late, the job is still slow and the
time inside that communicator could hold the whole slowdown, communication is the only place
left, so it is named by elimination. And a fail-slow may end before profiling starts: when the
profiled iteration time is back near the pre-slowdown one and nothing stands out, the slowdown
was transient.

P2P calls (pipeline sends and receives) are not compared, since a receive waits for its sender,
but they bound each rank's gaps: time a rank spends waiting in a receive is not its own delay.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from greyhound.core.arrays import FloatArray, IntArray
from greyhound.core.contribution import CollectiveObservation, classify_slow
from greyhound.core.localize import GroupTimings, SlowGroup, codes, combine_codes, find_slow_groups
from greyhound.core.period import find_period

LocalizedKind = Literal["compute_slow", "comm_slow", "mixed_slow", "none"]
NodeLabel = int | str


@dataclass(frozen=True, slots=True, eq=False)
class ProfiledCalls:
    """Every call the ranks completed in the window, one element per rank per call.

    ``comm_id`` is signed 64-bit (the cores' int64); ``p2p`` marks sends and receives, whose
    ``seq`` is not a collective instance. ``enter_ns``/``exit_ns`` are each call's arrival and
    completion, ns on each rank's own clock: GPU start and end where the hook timed the call
    (see core.gpu_timeline), host times only for a host-only rank. ``gap_known`` is False where
    the rank's previous call is missing (its timing was dropped, or its instance incomplete), so
    the gap before this call is not the rank's own delay; None: all known.
    """

    rank: IntArray
    comm_id: IntArray
    comm_rank: IntArray
    nranks: IntArray
    seq: IntArray
    op: NDArray[Any]
    nbytes: IntArray
    p2p: NDArray[np.bool_]
    enter_ns: FloatArray
    exit_ns: FloatArray
    gap_known: NDArray[np.bool_] | None = None

    def __post_init__(self) -> None:
        for name in ("rank", "comm_id", "comm_rank", "nranks", "seq", "nbytes"):
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=np.int64))
        for name in ("enter_ns", "exit_ns"):
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=np.float64))
        object.__setattr__(self, "op", np.asarray(self.op))
        object.__setattr__(self, "p2p", np.asarray(self.p2p, dtype=bool))
        n = len(self.rank)
        known = np.ones(n, bool) if self.gap_known is None else self.gap_known
        object.__setattr__(self, "gap_known", np.asarray(known, dtype=bool))
        if any(len(getattr(self, f)) != n for f in self.__slots__):
            raise ValueError("ProfiledCalls arrays must have equal lengths")

    def __len__(self) -> int:
        return len(self.rank)

    def take(self, keep: NDArray[np.bool_]) -> ProfiledCalls:
        return ProfiledCalls(**{f: getattr(self, f)[keep] for f in self.__slots__})

    def known_gaps(self) -> NDArray[np.bool_]:
        return np.asarray(self.gap_known, dtype=bool)

    def drop(self, keep: NDArray[np.bool_]) -> ProfiledCalls:
        """The rows in ``keep``; a kept row whose rank's previous call (by arrival) is dropped
        loses its gap, which would otherwise span the dropped call."""
        order = np.lexsort((self.enter_ns, self.rank))
        same = self.rank[order][1:] == self.rank[order][:-1]
        known = self.known_gaps().copy()
        known[order[1:]] &= ~same | keep[order[:-1]]
        columns: dict[str, Any] = {f: getattr(self, f)[keep] for f in self.__slots__}
        columns["gap_known"] = known[keep]
        return ProfiledCalls(**columns)


@dataclass(frozen=True, slots=True)
class SlowLocalization:
    kind: LocalizedKind
    transient: bool
    ranks: list[int]
    compute_ranks: list[int]
    comm_ids: list[int]  # signed 64-bit, as in ProfiledCalls
    slow_groups: list[int]
    nodes: list[NodeLabel]
    links: list[tuple[NodeLabel, NodeLabel]]
    evidence: dict[str, Any] = field(default_factory=dict)


def complete_instances(calls: ProfiledCalls) -> NDArray[np.bool_]:
    """Rows to keep: P2P rows, and collective rows whose instance every member reported.

    The window cuts instances at its edges; a partial one misses its last arrival, which would
    overstate its communication time and hide who was late.
    """
    coll = ~calls.p2p
    keep = calls.p2p.copy()
    if not coll.any():
        return keep
    inst, _ = combine_codes(calls.comm_id[coll], calls.seq[coll])
    members = np.bincount(inst)
    keep[coll] = members[inst] >= calls.nranks[coll]
    return keep


def observation(calls: ProfiledCalls) -> CollectiveObservation:
    """Collectives as they are; each P2P row its own one-member instance in its own cluster,
    so it ends the previous gap and starts the next one but is compared with nothing."""
    n = len(calls)
    comm = calls.comm_id.copy()
    op = calls.op.astype(object)
    nbytes = calls.nbytes.copy()
    seq = calls.seq.copy()
    p2p = np.flatnonzero(calls.p2p)
    if p2p.size:
        # ids below every real one, so results can never name a P2P stand-in
        base = int(calls.comm_id.min(initial=0)) - 1
        comm[p2p] = base - np.arange(p2p.size)
        op[p2p] = "p2p"
        nbytes[p2p] = -1 - np.arange(p2p.size)
        seq[p2p] = 0
    return CollectiveObservation(comm_id=comm, seq=seq, rank=calls.rank,
                                 enter_ns=calls.enter_ns, exit_ns=calls.exit_ns,
                                 op=op.astype(str), nbytes=nbytes,
                                 algo=np.zeros(n, np.int64), gap_known=calls.known_gaps())


def group_timings(calls: ProfiledCalls) -> GroupTimings:
    """One element per collective instance: the least time any member spent inside it (the
    last arrival waits for no one), its op and bytes; the algorithm is not known here."""
    coll = np.flatnonzero(~calls.p2p)
    if coll.size == 0:
        empty = np.zeros(0, np.int64)
        return GroupTimings(empty, np.zeros(0, str), empty, np.zeros(0, str), np.zeros(0))
    inst, first = combine_codes(calls.comm_id[coll], calls.seq[coll])
    inside = np.maximum(calls.exit_ns[coll] - calls.enter_ns[coll], 0.0)
    duration = np.full(len(first), np.inf)
    np.minimum.at(duration, inst, inside)
    rows = coll[first]
    return GroupTimings(group_id=calls.comm_id[rows], op=calls.op[rows].astype(str),
                        nbytes=calls.nbytes[rows], algo=np.full(len(rows), "unknown"),
                        duration_ns=duration)


def iteration_time_s(calls: ProfiledCalls, *, max_ranks: int = 64) -> float | None:
    """The profiled iteration time: each rank's call-sequence period, and the median time
    between a call and the same call one period later (GREYHOUND's definition); None when no
    rank shows four periods yet. A sample of ranks is enough: synchronous ranks share it."""
    if len(calls) == 0:
        return None
    rank_values, rank_code = codes(calls.rank)
    picked = np.linspace(0, len(rank_values) - 1, min(max_ranks, len(rank_values))).astype(int)
    key_code, _ = combine_codes(codes(calls.op)[1], calls.comm_id, calls.nbytes,
                                np.where(calls.p2p, calls.comm_rank, -1))
    times: list[float] = []
    for r in np.unique(picked):
        mine = np.flatnonzero(rank_code == r)
        mine = mine[np.argsort(calls.enter_ns[mine], kind="stable")]
        period = find_period(key_code[mine])
        if period is None:
            continue
        enter = calls.enter_ns[mine]
        times.append(float(np.median(enter[period:] - enter[:-period])) / 1e9)
    return float(np.median(times)) if times else None


# A rank's excess time outside NCCL below this share of its communicator's largest is not named.
WORST_SHARE = 0.5
# Nor one whose excess explains less than this share of the slowdown being localised: a
# contended host's ranks spend the job's added time outside NCCL while their peers wait inside
# it, so their excess share of the slowed iteration is about (after - before) / after.
EXPLAINS = 0.5
MIN_OUTSIDE_SHARE = 0.02  # and an excess outside NCCL under this share is never a host's
# A profiled period below this share of the healthy iteration is a repeat inside the iteration.
SUBPERIOD_SHARE = 0.75


def localize_slow(calls: ProfiledCalls, *, node_of_rank: Mapping[int, NodeLabel],
                  before_s: float, after_s: float, threshold: float = 0.10,
                  still_slow_share: float = 0.5) -> SlowLocalization:
    """Classify the window's slowdown and name ranks, communicators, nodes and links.

    ``before_s``/``after_s`` are the detection's iteration times: the job is still slow when
    the profiled iteration time has kept at least ``still_slow_share`` of that increase.
    """
    calls = calls.drop(complete_instances(calls))
    suspicion = classify_slow(observation(calls), comm_threshold=threshold)
    groups = find_slow_groups(group_timings(calls), threshold=threshold)
    iteration = iteration_time_s(calls)
    subperiod = None
    if iteration is not None and iteration < SUBPERIOD_SHARE * before_s:
        # Shorter than the healthy iteration: not the iteration but a repeat inside it (a
        # window shorter than an iteration sees 1F1B's steady state repeat every micro-batch).
        # The window cannot tell whether the job is still slow: it is taken to be.
        subperiod, iteration = iteration, None
    increase = max(after_s - before_s, 0.0)
    still_slow = iteration is None or iteration >= before_s + still_slow_share * increase
    comm_set = set(suspicion.comm_ids) | {g.group_id for g in groups}
    evidence: dict[str, Any] = {
        "calls": len(calls),
        "ranks_observed": len(np.unique(calls.rank)),
        "comms_observed": len(np.unique(calls.comm_id[~calls.p2p])),
        "iteration_before_s": before_s,
        "iteration_after_s": after_s,
        "iteration_profiled_s": iteration,
        "subiteration_period_s": subperiod,
        "still_slow": still_slow,
        "late_threshold_ns": suspicion.evidence.get("late_threshold_ns"),
        "gap_jitter_ns": suspicion.evidence.get("gap_jitter_ns"),
        "job_p": suspicion.evidence.get("job_p"),
        "compute": _compute_evidence(suspicion.evidence),
        "comms": _comm_evidence(suspicion.evidence),
        "groups": [_group_evidence(g) for g in groups[:32]],
    }
    slow_hosts: list[int] = []
    if not suspicion.compute_ranks and not comm_set and still_slow and increase > 0:
        # Nobody late within its own communicators: a whole group may be slow together (host
        # contention on a node slows every GPU of its TP group alike). Compare each rank's time
        # outside NCCL with its peers in the other communicators it belongs to.
        slow_hosts, busy = _slow_outside_nccl(
            calls, threshold, min_share=max(MIN_OUTSIDE_SHARE, EXPLAINS * increase / after_s))
        evidence["outside_nccl"] = busy
    if not suspicion.compute_ranks and not comm_set and not slow_hosts and still_slow \
            and increase > 0:
        eliminated = _comms_by_elimination(calls, iteration or after_s, increase,
                                           still_slow_share)
        comm_set = {c for c, _ in eliminated}
        evidence["by_elimination"] = [{"comm_id": c, "comm_s_per_iteration": s}
                                      for c, s in eliminated]
    compute = sorted(set(suspicion.compute_ranks) | set(slow_hosts))
    comm_ids = sorted(comm_set)
    kind: LocalizedKind = ("mixed_slow" if compute and comm_ids else "compute_slow" if compute
                           else "comm_slow" if comm_ids else "none")
    members = _members(calls)
    comm_ranks = sorted({r for c in comm_ids for r in members.get(c, [])})
    links = _suspect_links(calls, members, set(comm_ids), node_of_rank)
    nodes: set[NodeLabel] = {node_of_rank[r] for r in compute if r in node_of_rank}
    if comm_ids:
        nodes |= ({n for pair in links for n in pair} if links else
                  {node_of_rank[r] for r in comm_ranks if r in node_of_rank})
    p_by_rank = dict(zip(suspicion.rank_ids.tolist(), suspicion.p.tolist(), strict=True))
    evidence["p"] = {str(r): _finite(p_by_rank.get(r)) for r in (compute or comm_ranks)[:64]}
    return SlowLocalization(
        kind=kind, transient=kind == "none" and not still_slow,
        ranks=sorted(set(compute) | set(comm_ranks)), compute_ranks=compute, comm_ids=comm_ids,
        slow_groups=[g.group_id for g in groups], nodes=sorted(nodes, key=str),
        links=links, evidence=evidence)


def _slow_outside_nccl(calls: ProfiledCalls, threshold: float,
                       min_share: float = MIN_OUTSIDE_SHARE) -> tuple[list[int], dict[str, Any]]:
    """Ranks that spend a larger share of their time outside NCCL than the other members of a
    communicator they belong to (by ``threshold`` relative and ``min_share`` absolute: the
    caller asks for a share that explains the slowdown, EXPLAINS).

    Waiting happens inside NCCL calls, so the share outside them is each rank's own work; peers
    of one communicator (a DP group: one rank per stage position) do the same work. On the GPU
    timeline that is the time the GPU spends between collectives. Spans across a missing call
    (``gap_known`` False) count neither as the rank's work nor as its time.
    """
    if len(calls) == 0:
        return [], {}
    order = np.lexsort((calls.enter_ns, calls.rank))
    rank, enter, exit_ = calls.rank[order], calls.enter_ns[order], calls.exit_ns[order]
    same = rank[1:] == rank[:-1]
    spans = np.where(same, np.maximum(enter[1:] - exit_[:-1], 0.0), 0.0)
    known = calls.known_gaps()[order][1:]
    rank_values, rank_code = codes(rank)
    own = np.bincount(rank_code[1:], weights=np.where(known, spans, 0.0),
                      minlength=len(rank_values))
    unknown = np.bincount(rank_code[1:], weights=np.where(known, 0.0, spans),
                          minlength=len(rank_values))
    lo = np.full(len(rank_values), np.inf)
    hi = np.full(len(rank_values), -np.inf)
    np.minimum.at(lo, rank_code, enter)
    np.maximum.at(hi, rank_code, exit_)
    share = own / np.maximum(hi - lo - unknown, 1.0)
    share_of = dict(zip(rank_values.tolist(), share.tolist(), strict=True))
    excess: dict[int, float] = {}  # per rank, its largest excess over a communicator's median
    for members in _members(calls).values():
        if len(members) < 3:
            continue  # two peers cannot say which of them is the odd one
        vals = np.array([share_of[r] for r in members])
        med = float(np.median(vals))
        for r, v in zip(members, vals.tolist(), strict=True):
            if v > med * (1.0 + threshold) and v - med > min_share:
                excess[r] = max(excess.get(r, 0.0), v - med)
    # Within a window shorter than an iteration, ranks at other pipeline phases differ from their
    # peers by a little; a contended host stands out by far: only excesses comparable to the
    # job's largest are named.
    worst = max(excess.values(), default=0.0)
    flagged = {r for r, e in excess.items() if e >= WORST_SHARE * worst}
    return sorted(flagged), {"share_by_rank": {str(r): round(v, 4) for r, v in
                                               sorted(share_of.items())[:256]}}


def _comms_by_elimination(calls: ProfiledCalls, iteration_s: float, increase_s: float,
                          share: float) -> list[tuple[int, float]]:
    """Communicators with no comparable peer whose time per iteration could hold the increase.

    Time per iteration: the communicator's summed instance times over the window, scaled from
    the window's length to one iteration.
    """
    timings = group_timings(calls)
    if len(timings.group_id) == 0:
        return []
    _, op_code = codes(timings.op)
    gid_values, gid_code = codes(timings.group_id)
    cluster, _ = combine_codes(op_code, timings.nbytes)
    _, cell_first = combine_codes(cluster, gid_code)
    comms_in_cluster = np.bincount(cluster[cell_first])
    alone = np.zeros(len(gid_values), dtype=bool)
    np.logical_or.at(alone, gid_code[cell_first], comms_in_cluster[cluster[cell_first]] == 1)
    total = np.bincount(gid_code, weights=timings.duration_ns, minlength=len(gid_values))
    out: list[tuple[int, float]] = []
    for g in np.flatnonzero(alone):
        comm = int(gid_values[g])
        rows = ~calls.p2p & (calls.comm_id == comm)
        span = _median_span_ns(calls.rank[rows], calls.enter_ns[rows], calls.exit_ns[rows])
        if span <= 0:
            continue
        per_iteration = float(total[g]) / span * iteration_s
        if per_iteration >= share * increase_s:
            out.append((comm, per_iteration))
    return out


def _median_span_ns(rank: IntArray, enter: FloatArray, exit_: FloatArray) -> float:
    _, code = codes(rank)
    n = int(code.max()) + 1 if len(code) else 0
    lo = np.full(n, np.inf)
    hi = np.full(n, -np.inf)
    np.minimum.at(lo, code, enter)
    np.maximum.at(hi, code, exit_)
    return float(np.median(hi - lo)) if n else 0.0


def _members(calls: ProfiledCalls) -> dict[int, list[int]]:
    """Each collective communicator's global ranks in communicator-rank (ring) order."""
    coll = np.flatnonzero(~calls.p2p)
    _, first = combine_codes(calls.comm_id[coll], calls.comm_rank[coll])
    rows = coll[first]
    order = np.lexsort((calls.comm_rank[rows], calls.comm_id[rows]))
    out: dict[int, list[int]] = {}
    for i in rows[order]:
        out.setdefault(int(calls.comm_id[i]), []).append(int(calls.rank[i]))
    return out


def _suspect_links(calls: ProfiledCalls, members: Mapping[int, list[int]], slow: set[int],
                   node_of_rank: Mapping[int, NodeLabel]) -> list[tuple[NodeLabel, NodeLabel]]:
    """Node pairs the slow communicators' rings cross and no healthy communicator crosses.

    Taken over the pairs every slow ring shares when there are any (one congested link slows
    every ring through it), else over all pairs they cross. A hypothesis for the validator's
    P2P checks, which measure each link.
    """
    if not slow:
        return []
    crossed = {c: _ring_pairs(m, node_of_rank) for c, m in members.items()}
    healthy = set().union(*(p for c, p in crossed.items() if c not in slow))
    slow_pairs = [crossed.get(c, set()) for c in slow]
    shared = set.intersection(*slow_pairs) if slow_pairs else set()
    candidates = (shared or set().union(*slow_pairs)) - healthy
    return sorted(candidates, key=lambda p: (str(p[0]), str(p[1])))


def _ring_pairs(ranks: list[int], node_of_rank: Mapping[int, NodeLabel]
                ) -> set[tuple[NodeLabel, NodeLabel]]:
    nodes = [node_of_rank.get(r) for r in ranks]
    out: set[tuple[NodeLabel, NodeLabel]] = set()
    for a, b in zip(nodes, nodes[1:] + nodes[:1], strict=True):
        if a is not None and b is not None and a != b:
            out.add((a, b) if str(a) <= str(b) else (b, a))
    return out


def _finite(v: float | None) -> float | None:
    return None if v is None or not np.isfinite(v) else float(v)


def _compute_evidence(ev: Mapping[str, Any]) -> list[dict[str, Any]]:
    ranks = list(ev.get("compute_ranks", []))
    cols = ("compute_p", "compute_late_share", "compute_mean_delay_ns")
    return [{"rank": r, **{c.removeprefix("compute_"): _finite(ev[c][i]) for c in cols if c in ev}}
            for i, r in enumerate(ranks[:64])]


def _comm_evidence(ev: Mapping[str, Any]) -> list[dict[str, Any]]:
    comms = list(ev.get("slow_comms", []))
    cols = ("comm_time_ns", "comm_baseline_ns", "comm_ratio")
    return [{"comm_id": c, **{k.removeprefix("comm_"): _finite(ev[k][i]) for k in cols if k in ev}}
            for i, c in enumerate(comms[:64])]


def _group_evidence(g: SlowGroup) -> dict[str, Any]:
    return {"comm_id": g.group_id, "op": g.op, "nbytes": g.nbytes, "time_ns": g.time_ns,
            "cluster_median_ns": g.cluster_median_ns, "ratio": g.ratio,
            "cluster_groups": g.evidence.get("cluster_groups")}
