"""Hang watching for one job, from the agents' counter samples.

A communicator is suspected hung when one of its members has a call that was enqueued and has
not completed on the GPU for longer than the job's adaptive threshold (HangPolicy), as CCL-D
calls a hang "communication lasting longer than a threshold". NCCL calls are asynchronous: the
host enqueues a collective and returns within microseconds, and a hung collective spins on the
GPU while the host blocks later in a synchronisation outside NCCL. So the wait that counts is
the age of the oldest call pending on the GPU (``gpu_pending_s``). But NCCL's host also waits
inside a call while the GPU idles: connection set-up at run time, bootstrap exchanges, a
stalled proxy thread, and every communicator init, split, shrink and destroy (the hook reports
those in flight too). So a rank's wait is the larger of its GPU pending age and its host's time
inside a call (``inflight_s``); a process without GPU completion marks (``gpu_marks`` = 0: no
CUDA runtime nor driver API) has only the latter. Each finding says which basis its rows had,
and which members had no marks (their GPU view is off: a hang on their GPU shows only once it
blocks their host inside NCCL).

Lifecycle calls wait for every rank to arrive, and ranks reach the first init minutes apart
when some load a model first: a wait inside one (``last_op`` an init/split/shrink/destroy while
the host is in flight) is judged against ``max(threshold, setup_floor_s)``.

Measuring a call's own pending time rather than the wall time since the counters last moved
means that long phases without NCCL work (checkpoint saves, evaluation loops: nothing is pending
on the GPU) never alarm, and that a simulated job held back by its consumer is not mistaken for a
hung one (its calls' virtual time stands still). Long waits inside a collective that end
normally (peers pending in a barrier while rank 0 writes a checkpoint) are learned: the next one
of that length does not alarm. Samples that stop arriving (the job ended, its agent went away)
stop the watch rather than raise a hang: that is a fail-stop, not a hang.

A hang that was reported ends when its communicator moves again (calls complete and the longest
waiter is no longer waiting that long): ``take_recovered`` hands those communicators out once, so
the tracker can report that the job's hang is over. The alarms survive a restart of the tracker
(``state_dict``): a communicator still stuck is not reported twice, one that moved meanwhile
is reported over at its first sample.

Bounds: waits that are not finite numbers are read as no wait, so ``Infinity`` never reaches
the threshold; communicators not sampled for ``forget_s`` are dropped (``forget``), and at most
``max_comms`` are watched (the least recently sampled go first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from greyhound.core.hang import HangPolicy
from greyhound.hookabi.layout import LIFECYCLE_OPS

COUNTER_FIELDS = ("rank", "comm_id", "comm_rank", "nranks", "entered", "completed",
                  "last_seq_entered", "last_seq_completed", "inflight_s", "last_op",
                  "last_count", "last_dtype", "gpu_marks", "gpu_completed", "gpu_seq_completed",
                  "gpu_pending_s", "gpu_pending_seq", "gpu_pending_op", "gpu_pending_count",
                  "gpu_pending_dtype", "last_peer", "gpu_pending_peer")
# Columns older agents do not send, and what they mean when absent: no peer known.
OPTIONAL_FIELDS = {"last_peer": -1, "gpu_pending_peer": -1}
# The profiler plugin's counters (a CounterBatch's ``progress``), kept per (communicator, rank).
PROGRESS_FIELDS = ("rank", "comm_id", "comm_rank", "kind", "channel", "peer", "posted", "done",
                   "bytes", "net_s", "stalled_s", "seq", "rate", "byte_rate", "net_bw")
_P_RANK, _P_COMM = PROGRESS_FIELDS.index("rank"), PROGRESS_FIELDS.index("comm_id")
_RANK, _COMM = COUNTER_FIELDS.index("rank"), COUNTER_FIELDS.index("comm_id")
_COMPLETED, _INFLIGHT = COUNTER_FIELDS.index("completed"), COUNTER_FIELDS.index("inflight_s")
_MARKS = COUNTER_FIELDS.index("gpu_marks")
_GPU_COMPLETED = COUNTER_FIELDS.index("gpu_completed")
_GPU_PENDING = COUNTER_FIELDS.index("gpu_pending_s")
_LAST_OP = COUNTER_FIELDS.index("last_op")
_SETUP_OPS = frozenset(int(op) for op in LIFECYCLE_OPS)

WaitBasis = Literal["gpu", "host", "mixed"]


def _age(value: Any) -> float:
    wait = float(value)
    return wait if math.isfinite(wait) and wait > 0.0 else 0.0


def row_wait_s(row: tuple[Any, ...]) -> float:
    """How long the row's rank has been waiting on its communicator: the larger of the age of
    its oldest call not done on the GPU (with GPU marks) and its host thread's time inside an
    NCCL call (0 for a value that is not a finite non-negative number)."""
    host = _age(row[_INFLIGHT])
    return max(_age(row[_GPU_PENDING]), host) if row[_MARKS] else host


def in_setup(row: tuple[Any, ...]) -> bool:
    """True when the row's wait is its host's inside a lifecycle call (init, split, shrink,
    destroy), not a call pending on the GPU."""
    host = _age(row[_INFLIGHT])
    return (int(row[_LAST_OP]) in _SETUP_OPS and host > 0.0
            and (not row[_MARKS] or _age(row[_GPU_PENDING]) <= host))


def _row_progress(row: tuple[Any, ...]) -> int:
    return int(row[_GPU_COMPLETED] if row[_MARKS] else row[_COMPLETED])


def wait_basis(rows: list[tuple[Any, ...]]) -> WaitBasis:
    marked = sum(1 for r in rows if r[_MARKS])
    return "gpu" if marked == len(rows) else "host" if marked == 0 else "mixed"


@dataclass(frozen=True, slots=True)
class HangFinding:
    comm_id: int
    stalled_s: float
    threshold_s: float
    waiting_ranks: tuple[int, ...]  # members with a call pending (GPU) or inside NCCL (host)
    members: tuple[int, ...]  # every rank with a counter row on the communicator
    basis: WaitBasis  # where the waits were read: GPU completion marks, host, or both
    marks_off: tuple[int, ...] = ()  # members without GPU completion marks: their GPU view is off
    setup: bool = False  # the longest wait is inside a communicator init/split/shrink/destroy


@dataclass
class _Comm:
    rows: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # rank -> latest row
    progress_rows: dict[int, list[tuple[Any, ...]]] = field(default_factory=dict)  # rank -> rows
    sampled_s: float = 0.0
    progress: int = -1  # calls done, summed over members (on the GPU where marks exist)
    longest_wait_s: float = 0.0  # longest wait seen since the last wait that ended
    setup_wait: bool = False  # ... and it is a host wait inside a lifecycle call
    alarmed: bool = False
    restored: bool = False  # alarmed before a restart: no progress count to compare yet


@dataclass
class JobHangMonitor:
    floor_s: float = 60.0
    multiple: float = 20.0
    stale_s: float = 10.0
    max_comms: int = 65_536
    setup_floor_s: float = 300.0
    policy: HangPolicy = field(init=False)
    comms: dict[int, _Comm] = field(default_factory=dict)
    _recovered: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.policy = HangPolicy(floor_s=self.floor_s, multiple=self.multiple)

    def observe_iteration(self, duration_s: float) -> None:
        if math.isfinite(duration_s) and duration_s > 0.0:
            self.policy.observe_iteration(duration_s)

    def alarmed(self) -> list[int]:
        """Communicators reported hung and not moving since."""
        return [cid for cid, c in self.comms.items() if c.alarmed]

    def take_recovered(self) -> list[int]:
        """Communicators reported hung that moved again since the last call (each once)."""
        out, self._recovered = self._recovered, []
        return out

    def forget(self, now_s: float, forget_s: float) -> list[int]:
        """Drop communicators not sampled for ``forget_s`` (destroyed, or their job left this
        tracker) and, past ``max_comms``, the least recently sampled; the dropped ids. A
        forgotten alarmed communicator is not reported as recovered: nobody saw it move. One
        restored from a saved state and not sampled since is kept until it is (its job's
        tracker state goes when the job does)."""
        gone = [cid for cid, c in self.comms.items()
                if now_s - c.sampled_s > forget_s and not c.restored]
        extra = len(self.comms) - len(gone) - self.max_comms
        if extra > 0:
            keep = sorted((c.sampled_s, cid) for cid, c in self.comms.items() if cid not in gone)
            gone += [cid for _, cid in keep[:extra]]
        for cid in gone:
            del self.comms[cid]
        return gone

    def observe_counters(self, sampled_s: float, columns: dict[str, list[Any]],
                         plugin: dict[str, list[Any]] | None = None) -> None:
        """One agent's sample: columnar rows (COUNTER_FIELDS) of its ranks' communicators, and
        the profiler plugin's rows of the same ranks (PROGRESS_FIELDS), which replace each
        sampled (communicator, rank)'s previous ones."""
        n = len(columns["rank"])
        cols = [columns[f] if len(columns.get(f, ())) == n or f not in OPTIONAL_FIELDS
                else [OPTIONAL_FIELDS[f]] * n for f in COUNTER_FIELDS]
        rows = list(zip(*cols, strict=True))
        prog: dict[tuple[int, int], list[tuple[Any, ...]]] = {}
        if plugin:
            for prow in zip(*(plugin[f] for f in PROGRESS_FIELDS), strict=True):
                prog.setdefault((int(prow[_P_COMM]), int(prow[_P_RANK])), []).append(prow)
        touched: set[int] = set()
        for row in rows:
            comm_id = int(row[_COMM])
            comm = self.comms.get(comm_id)
            if comm is None:
                comm = self.comms[comm_id] = _Comm()
            comm.rows[int(row[_RANK])] = row
            comm.progress_rows[int(row[_RANK])] = prog.get((comm_id, int(row[_RANK])), [])
            comm.sampled_s = max(comm.sampled_s, sampled_s)
            touched.add(comm_id)
        for comm_id in touched:
            comm = self.comms[comm_id]
            progress = sum(_row_progress(r) for r in comm.rows.values())
            longest = max(comm.rows.values(), key=row_wait_s)
            waiting = row_wait_s(longest)
            setup_now = waiting > 0.0 and in_setup(longest)
            if comm.setup_wait and not setup_now and waiting < comm.longest_wait_s:
                # The ranks left the lifecycle call they waited in: over, with or without a call
                # completed since (a communicator may carry none), and not a normal phase to learn.
                if comm.alarmed:
                    self._recovered.append(comm_id)
                comm.progress, comm.alarmed = max(comm.progress, progress), False
                comm.longest_wait_s, comm.setup_wait = waiting, setup_now
                continue
            if comm.restored:  # alarmed before a restart: over unless it still waits that long
                comm.restored = False
                comm.progress = progress
                if waiting > self.policy.threshold_s():
                    comm.longest_wait_s = waiting
                else:
                    comm.alarmed, comm.longest_wait_s = False, waiting
                    self._recovered.append(comm_id)
                continue
            if progress > comm.progress:
                # A wait ended when calls completed and the longest waiter is no longer waiting
                # that long. (Progress alone is not enough on the GPU: calls on another stream
                # may complete while the oldest pending one stays stuck.)
                ended = comm.progress < 0 or waiting < comm.longest_wait_s
                if comm.progress >= 0 and ended and not comm.setup_wait and (
                        comm.alarmed or comm.longest_wait_s > self.multiple * self.policy.typical_s()):
                    # It came back: whatever that was, the job survives waits this long.
                    self.policy.observe_recovered_pause(comm.longest_wait_s)
                comm.progress = progress
                if ended:
                    if comm.alarmed:
                        self._recovered.append(comm_id)
                    comm.longest_wait_s, comm.alarmed = waiting, False
                    comm.setup_wait = setup_now
                    continue
            if waiting >= comm.longest_wait_s:
                comm.longest_wait_s, comm.setup_wait = waiting, setup_now

    def check(self, now_s: float) -> list[HangFinding]:
        out: list[HangFinding] = []
        threshold = self.policy.threshold_s()
        setup_threshold = max(threshold, self.setup_floor_s)
        for comm_id, comm in self.comms.items():
            if comm.alarmed or now_s - comm.sampled_s > self.stale_s:
                continue
            waits = {r: row_wait_s(row) for r, row in comm.rows.items() if row_wait_s(row) > 0.0}
            over = {r: w for r, w in waits.items()
                    if w > (setup_threshold if in_setup(comm.rows[r]) else threshold)}
            if not over:
                continue
            comm.alarmed = True
            worst = max(over, key=lambda r: over[r])
            setup = in_setup(comm.rows[worst])
            out.append(HangFinding(
                comm_id=comm_id, stalled_s=over[worst],
                threshold_s=setup_threshold if setup else threshold,
                waiting_ranks=tuple(sorted(waits)), members=tuple(sorted(comm.rows)),
                basis=wait_basis(list(comm.rows.values())),
                marks_off=tuple(sorted(r for r, row in comm.rows.items() if not row[_MARKS])),
                setup=setup))
        return out

    def rows_for(self, findings: list[HangFinding], limit: int = 8192) -> dict[str, list[Any]]:
        """The latest counter rows a diagnosis needs to tell a root cause from its cascade: the
        stalled communicators, every other communicator with a call pending (the root's own
        call may not be the longest wait: peers that entered the DP all-reduce early have waited
        longer), and the other communicators of all their members (where a rank that never
        entered is idle). Columnar; beyond ``limit`` rows the longest waits are kept."""
        stalled = {f.comm_id for f in findings}
        waits = {cid: max(row_wait_s(r) for r in comm.rows.values())
                 for cid, comm in self.comms.items() if comm.rows}
        busy = sorted((cid for cid, w in waits.items() if w > 0.0 and cid not in stalled),
                      key=lambda cid: -waits[cid])
        first = [*sorted(stalled), *busy]
        ranks = {int(r) for cid in first if cid in self.comms for r in self.comms[cid].rows}
        rest = [cid for cid, comm in self.comms.items()
                if cid not in stalled and waits.get(cid, 0.0) <= 0.0]
        picked: list[tuple[Any, ...]] = []
        for cid in first:
            picked += self.comms[cid].rows.values() if cid in self.comms else []
        for cid in rest:
            picked += [row for row in self.comms[cid].rows.values() if int(row[_RANK]) in ranks]
        rows = sorted(picked[:limit])
        return {f: [r[i] for r in rows] for i, f in enumerate(COUNTER_FIELDS)}

    def latest_progress(self, limit: int = 8192) -> dict[str, list[Any]]:
        """Every communicator's latest plugin rows (columnar, PROGRESS_FIELDS): the links' rates
        over the agents' last windows, which name a slow link while the job runs."""
        picked = [r for comm in self.comms.values() for rows in comm.progress_rows.values()
                  for r in rows][:limit]
        return {f: [r[i] for r in picked] for i, f in enumerate(PROGRESS_FIELDS)}

    def progress_for(self, findings: list[HangFinding], limit: int = 8192) -> dict[str, list[Any]]:
        """The profiler plugin's latest rows of the stalled communicators (columnar,
        PROGRESS_FIELDS; empty where no plugin runs): where inside its collective each member
        stopped."""
        picked: list[tuple[Any, ...]] = []
        for f in sorted(findings, key=lambda f: -f.stalled_s):
            comm = self.comms.get(f.comm_id)
            if comm is not None:
                picked += [r for rows in comm.progress_rows.values() for r in rows]
        rows = picked[:limit]
        return {f: [r[i] for r in rows] for i, f in enumerate(PROGRESS_FIELDS)}

    def state_dict(self) -> dict[str, Any]:
        """What a restarted tracker needs: the learned iteration times and long phases, and
        which communicators are reported hung.

        The other per-communicator watches are not kept: the next samples rebuild them, and a
        call already stuck reports its own pending time, so a hang is still raised.
        """
        policy = self.policy
        return {"floor_s": self.floor_s, "multiple": self.multiple, "stale_s": self.stale_s,
                "setup_floor_s": self.setup_floor_s, "recent": list(policy._recent),
                "long": list(policy._long), "alarmed": self.alarmed()}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> JobHangMonitor:
        mon = cls(floor_s=float(state["floor_s"]), multiple=float(state["multiple"]),
                  stale_s=float(state["stale_s"]),
                  setup_floor_s=float(state.get("setup_floor_s", cls.setup_floor_s)))
        mon.policy._recent.extend(x for x in map(float, state["recent"])
                                  if math.isfinite(x) and x > 0.0)
        mon.policy._long.extend(x for x in map(float, state["long"])
                                if math.isfinite(x) and x > 0.0)
        for cid in state.get("alarmed", []):
            mon.comms[int(cid)] = _Comm(alarmed=True, restored=True)
        return mon
