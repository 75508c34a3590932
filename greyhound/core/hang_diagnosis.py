"""CCL-D's three hang causes, from per-communicator counters and each rank's last records.

A communicator is hung when some member has a collective pending and nothing happened on that
communicator for `stall_ns`. Then, comparing its members:
  hang_not_entered   some ranks entered fewer collectives than the others: they never reached the
                     next one (named with its op and sequence number, taken from the ranks that did);
  hang_inconsistent  ranks at the same sequence number entered a different op, count or datatype
                     than the majority;
  hang_hardware      all entered the same collective and agree on it, yet some never complete: the
                     ones still pending are named (when every rank is pending, the optional
                     kernel-level progress counter, CCL-D's SendCount + RecvCount, names the laggard).
Hangs cascade: a rank that never entered the DP all-reduce because it is itself stuck in a hung TP
collective is a symptom, not a cause, so such diagnoses are dropped in favour of the root.

Point-to-point communicators (pipeline sends and receives) are not compared member against member:
each stage makes its own number of calls, so entered counts and the op at a sequence number differ
by design. A rank pending there counts as busy (its absence elsewhere is a symptom), and when no
collective explains the hang, a pipeline pair whose ends are both inside calls that never return
is named (hang_hardware).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from greyhound.core.arrays import FloatArray, IntArray
from greyhound.core.localize import Evidence, codes, combine_codes
from greyhound.hookabi.layout import P2P_OP_NAMES

HangKind = Literal["hang_not_entered", "hang_inconsistent", "hang_hardware"]
SYMPTOMS_LISTED = 256  # communicator ids of cascaded symptoms kept in a diagnosis's evidence


@dataclass(frozen=True, slots=True, eq=False)
class CommCounters:
    """One element per (communicator, member rank); a member with nothing recorded has entered=0.

    `entered`/`completed` count collectives (their sequence numbers); a send or receive has none,
    so `in_call` marks a member inside any call (a pipeline send/receive included).
    `progress` is an optional kernel-level progress count (sends + receives executed).
    """

    comm_id: IntArray
    rank: IntArray
    entered: IntArray
    completed: IntArray
    progress: IntArray | None = None
    in_call: NDArray[np.bool_] | None = None

    def __post_init__(self) -> None:
        for name in ("comm_id", "rank", "entered", "completed"):
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=np.int64))
        if self.progress is not None:
            object.__setattr__(self, "progress", np.asarray(self.progress, dtype=np.int64))
        if self.in_call is not None:
            object.__setattr__(self, "in_call", np.asarray(self.in_call, dtype=bool))
        n = len(self.comm_id)
        arrays: list[NDArray[Any]] = [self.rank, self.entered, self.completed]
        if self.progress is not None:
            arrays.append(self.progress)
        if self.in_call is not None:
            arrays.append(self.in_call)
        if any(len(a) != n for a in arrays):
            raise ValueError("CommCounters arrays must have equal lengths")


@dataclass(frozen=True, slots=True, eq=False)
class LastRecords:
    """The most recent records of each (communicator, rank): seq is 0-based, so the record of the
    k-th collective entered has seq k-1; exit_ns < 0 while the collective is pending."""

    comm_id: IntArray
    rank: IntArray
    seq: IntArray
    op: NDArray[Any]
    count: IntArray
    dtype: IntArray
    enter_ns: FloatArray
    exit_ns: FloatArray

    def __post_init__(self) -> None:
        for name in ("comm_id", "rank", "seq", "count", "dtype"):
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=np.int64))
        for name in ("enter_ns", "exit_ns"):
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=np.float64))
        object.__setattr__(self, "op", np.asarray(self.op))
        n = len(self.comm_id)
        arrays = (self.rank, self.seq, self.op, self.count, self.dtype, self.enter_ns, self.exit_ns)
        if any(len(a) != n for a in arrays):
            raise ValueError("LastRecords arrays must have equal lengths")


@dataclass(frozen=True, slots=True)
class HangDiagnosis:
    kind: HangKind
    comm_id: int
    seq: int
    op: str
    ranks: list[int]
    evidence: Evidence = field(default_factory=dict)


def diagnose_hang(
    counters: CommCounters,
    last: LastRecords,
    *,
    now_ns: int,
    stall_ns: int = 5_000_000_000,
) -> list[HangDiagnosis]:
    """Diagnose every hung communicator; root causes first, cascaded symptoms dropped."""
    if len(counters.comm_id) == 0:
        return []
    all_comms = np.concatenate((counters.comm_id, last.comm_id))
    comm_values, comm_all = codes(all_comms)
    n_comms = len(comm_values)
    c_comm, r_comm = comm_all[: len(counters.comm_id)], comm_all[len(counters.comm_id) :]

    # stalled: a pending member and no activity on the communicator for stall_ns
    activity = np.full(n_comms, -np.inf)
    np.maximum.at(activity, r_comm, np.maximum(last.enter_ns, last.exit_ns))
    pending = counters.entered > counters.completed
    busy = pending if counters.in_call is None else pending | counters.in_call
    has_pending = np.bincount(c_comm[busy], minlength=n_comms) > 0
    stalled = has_pending & (now_ns - activity >= stall_ns)
    if not np.any(stalled):
        return []

    max_entered = np.zeros(n_comms, np.int64)
    np.maximum.at(max_entered, c_comm, counters.entered)
    stuck_seq = max_entered - 1
    lagging = counters.entered < max_entered[c_comm]

    # records at each communicator's stuck sequence number, with a code for (op, count, dtype)
    op_values, op_code = codes(last.op)
    at_stuck = last.seq == stuck_seq[r_comm]
    sig, _ = combine_codes(op_code, last.count, last.dtype)
    cell, cell_first = combine_codes(r_comm[at_stuck], sig[at_stuck])
    cell_size = np.bincount(cell, minlength=len(cell_first))
    cell_comm = r_comm[at_stuck][cell_first]
    # majority signature per comm: largest cell; a tie (two ranks, one each) goes to the
    # signature the whole job uses most, since a lone wrong call is rarer than the usual one
    cell_sig = sig[at_stuck][cell_first]
    job_wide = np.bincount(sig)[cell_sig]
    order = np.lexsort((cell_sig, -job_wide, -cell_size, cell_comm))
    lead = np.ones(len(order), dtype=bool)
    lead[1:] = cell_comm[order][1:] != cell_comm[order][:-1]
    majority_sig = np.full(n_comms, -1, np.int64)
    majority_sig[cell_comm[order][lead]] = sig[at_stuck][cell_first][order][lead]
    majority_rec = np.full(n_comms, -1, np.int64)
    stuck_rows = np.flatnonzero(at_stuck)
    majority_rec[cell_comm[order][lead]] = stuck_rows[cell_first][order][lead]
    odd_record = at_stuck & (sig != majority_sig[r_comm])

    # ranks inside any call are busy there: their absence elsewhere is a symptom (a lagging rank
    # is never pending in the communicator where it lags and is idle). Not only stalled comms:
    # a rank that joined the cascade late has waited less than the stall time.
    # one lookup per rank, not a set search per stalled communicator: in a job-wide cascade
    # nearly every communicator is stalled
    rank_values, rank_code = codes(counters.rank)
    rank_busy = np.bincount(rank_code[busy], minlength=len(rank_values)) > 0
    p2p_comm = np.zeros(n_comms, bool)
    p2p_op = np.isin(op_values.astype(str), P2P_OP_NAMES)
    p2p_comm[r_comm[p2p_op[op_code]]] = True

    counter_order, counter_start = _split_by(c_comm, n_comms)
    odd_order, odd_start = _split_by(r_comm[odd_record], n_comms)
    odd_index = np.flatnonzero(odd_record)
    rec_order, rec_start = _split_by(r_comm, n_comms)
    found: list[HangDiagnosis] = []
    symptoms: list[HangDiagnosis] = []

    def visit(c: int) -> None:
        rows = counter_order[counter_start[c] : counter_start[c + 1]]
        rec = majority_rec[c]
        op = str(op_values[op_code[rec]]) if rec >= 0 else "unknown"
        seq = int(stuck_seq[c])
        base: Evidence = {
            "comm_id": int(comm_values[c]),
            "seq": seq,
            "op": op,
            "members": len(rows),
            "stalled_ns": float(now_ns - activity[c]),
            "max_entered": int(max_entered[c]),
        }
        if rec >= 0:
            base["count"] = int(last.count[rec])
            base["dtype"] = int(last.dtype[rec])
        comm_records = rec_order[rec_start[c] : rec_start[c + 1]]
        lag_rows = rows[lagging[rows]]
        idle_lag = lag_rows[~pending[lag_rows]]
        stuck_lag = lag_rows[pending[lag_rows]]
        if len(idle_lag):
            blocked = rank_busy[rank_code[idle_lag]]
            root = idle_lag[~blocked] if not bool(np.all(blocked)) else idle_lag
            missing = int(counters.entered[root].min())
            ev: Evidence = {
                **base,
                "lagging_entered": [int(e) for e in counters.entered[idle_lag]],
                "never_reached_seq": missing,
                "blocked_elsewhere": [int(r) for r in counters.rank[idle_lag][blocked]],
            }
            diag = _at_seq(
                "hang_not_entered",
                int(comm_values[c]),
                counters.rank[root],
                missing,
                comm_records,
                last,
                op_values,
                op_code,
                ev,
            )
            (symptoms if bool(np.all(blocked)) else found).append(diag)
        if len(stuck_lag):
            # entered an earlier collective that the others completed, and never left it
            stuck_at = int(counters.entered[stuck_lag].min()) - 1
            ev = {**base, "pending_ranks": len(stuck_lag), "others_completed": 1, "localized": 1}
            found.append(
                _at_seq(
                    "hang_hardware",
                    int(comm_values[c]),
                    counters.rank[stuck_lag],
                    stuck_at,
                    comm_records,
                    last,
                    op_values,
                    op_code,
                    ev,
                )
            )
        odd_rows = odd_index[odd_order[odd_start[c] : odd_start[c + 1]]]
        if len(odd_rows):
            odd_ranks = sorted({int(r) for r in last.rank[odd_rows]})
            odd_ev: Evidence = {
                **base,
                "inconsistent_ranks": list(odd_ranks),
                "their_ops": [str(op_values[op_code[i]]) for i in odd_rows],
                "their_counts": [int(last.count[i]) for i in odd_rows],
                "their_dtypes": [int(last.dtype[i]) for i in odd_rows],
            }
            found.append(HangDiagnosis("hang_inconsistent", int(comm_values[c]), seq, op, odd_ranks, odd_ev))
        if len(lag_rows) == 0 and len(odd_rows) == 0:
            found.append(_hardware(counters, rows, base, int(comm_values[c]), seq, op))

    # Most stalled communicators of a job-wide cascade are pure symptoms (every missing member
    # is busy elsewhere, nothing else odd): classified in bulk, examined one by one only when
    # nothing else explains the hang.
    idle_lag_row = lagging & ~pending
    n_idle = np.bincount(c_comm[idle_lag_row], minlength=n_comms)
    n_free = np.bincount(c_comm[idle_lag_row & ~rank_busy[rank_code]], minlength=n_comms)
    n_stuck = np.bincount(c_comm[lagging & pending], minlength=n_comms)
    n_odd = np.bincount(r_comm[odd_record], minlength=n_comms)
    candidates = stalled & ~p2p_comm
    pure = candidates & (n_idle > 0) & (n_free == 0) & (n_stuck == 0) & (n_odd == 0)
    for c in np.flatnonzero(candidates & ~pure):
        visit(int(c))
    unvisited = [int(comm_values[c]) for c in np.flatnonzero(pure)] if found else []
    if not found:
        for c in np.flatnonzero(pure):
            visit(int(c))
    symptom_ids = [d.comm_id for d in symptoms] + unvisited
    if not found:
        found = _stuck_in_p2p(symptom_ids, counters.rank, busy, last, c_comm, r_comm,
                              stalled & p2p_comm, op_values, op_code, comm_values)
    if not found:
        found = symptoms  # a cycle of communicators waiting on each other: report them all
    else:
        for d in found:
            d.evidence["symptom_comms"] = list[object](symptom_ids[:SYMPTOMS_LISTED])
    return found


def _at_seq(
    kind: HangKind,
    comm: int,
    ranks: IntArray,
    seq: int,
    comm_records: IntArray,
    last: LastRecords,
    op_values: NDArray[Any],
    op_code: IntArray,
    evidence: Evidence,
) -> HangDiagnosis:
    """A diagnosis at `seq`, with the op that the other ranks recorded there (if still held)."""
    named = sorted(int(r) for r in ranks)
    there = comm_records[last.seq[comm_records] == seq]
    op = str(op_values[op_code[there[0]]]) if len(there) else str(evidence["op"])
    evidence = {**evidence, "seq": seq, "op": op, "ranks": list(named)}
    if len(there):
        evidence["count"] = int(last.count[there[0]])
        evidence["dtype"] = int(last.dtype[there[0]])
    return HangDiagnosis(kind, comm, seq, op, named, evidence)


def _stuck_in_p2p(
    symptom_ids: list[int],
    rank: IntArray,
    busy: NDArray[np.bool_],
    last: LastRecords,
    c_comm: IntArray,
    r_comm: IntArray,
    stalled_p2p: NDArray[np.bool_],
    op_values: NDArray[Any],
    op_code: IntArray,
    comm_values: IntArray,
) -> list[HangDiagnosis]:
    """Pipeline communicators whose every member is inside a send or receive that never
    returns: nobody there is missing, so the pair itself is where the job stopped (without
    kernel-level progress counters the two ends cannot be told apart)."""
    out: list[HangDiagnosis] = []
    for c in np.flatnonzero(stalled_p2p):
        rows = np.flatnonzero(c_comm == c)
        if len(rows) < 2 or not bool(np.all(busy[rows])):
            continue
        named = sorted(int(r) for r in rank[rows])
        rec = np.flatnonzero(r_comm == c)
        seq = int(last.seq[rec[0]]) if len(rec) else -1
        op = str(op_values[op_code[rec[0]]]) if len(rec) else "unknown"
        ev: Evidence = {"comm_id": int(comm_values[c]), "seq": seq, "op": op, "ranks": list[object](named),
                        "pending_ranks": len(named), "point_to_point": 1,
                        "their_ops": [str(op_values[op_code[i]]) for i in rec],
                        "their_seqs": [int(last.seq[i]) for i in rec],
                        "symptom_comms": list[object](symptom_ids[:SYMPTOMS_LISTED])}
        out.append(HangDiagnosis("hang_hardware", int(comm_values[c]), seq, op, named, ev))
    return out


def _split_by(group: IntArray, n_groups: int) -> tuple[IntArray, IntArray]:
    """Element indices sorted by group, and where each group's run starts (n_groups + 1 bounds)."""
    order = np.argsort(group, kind="stable").astype(np.int64)
    start = np.zeros(n_groups + 1, np.int64)
    np.cumsum(np.bincount(group, minlength=n_groups), out=start[1:])
    return order, start


def _hardware(
    counters: CommCounters, rows: IntArray, base: Evidence, comm: int, seq: int, op: str
) -> HangDiagnosis:
    """All members entered the same collective: name those that never complete it."""
    pend = counters.entered[rows] > counters.completed[rows]
    ev: Evidence = {**base, "pending_ranks": int(np.count_nonzero(pend))}
    culprits = rows[pend]
    if bool(np.all(pend)) and counters.progress is not None:
        prog = counters.progress[rows]
        median = float(np.median(prog))
        low = prog < median
        ev["progress_median"] = median
        ev["progress_min"] = int(prog.min())
        culprits = rows[low & (prog == prog.min())] if bool(np.any(low)) else rows
        ev["localized"] = int(bool(np.any(low)))
    else:
        ev["localized"] = int(not bool(np.all(pend)))
    ranks = sorted(int(r) for r in counters.rank[culprits])
    ev["hung_ranks"] = list(ranks)
    return HangDiagnosis("hang_hardware", comm, seq, op, ranks, ev)
