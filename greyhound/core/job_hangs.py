"""Hang watching for one job, from the agents' counter samples.

A communicator is suspected hung when one of its members has been inside a single NCCL call for
longer than the job's adaptive threshold (HangPolicy), as CCL-D calls a hang "communication
lasting longer than a threshold". Measuring the call's own time inside NCCL, as the hook reports
it, rather than the wall time since the counters last moved, means that long phases without NCCL
(checkpoint saves, evaluation loops) never alarm, and that a simulated job held back by its
consumer is not mistaken for a hung one (its calls' virtual time stands still). Long waits inside
a collective that end normally (a barrier while rank 0 writes a checkpoint) are learned: the next
one of that length does not alarm. Samples that stop arriving (the job ended, its agent went
away) stop the watch rather than raise a hang: that is a fail-stop, not a hang.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from greyhound.core.hang import HangPolicy

COUNTER_FIELDS = ("rank", "comm_id", "comm_rank", "nranks", "entered", "completed",
                  "last_seq_entered", "last_seq_completed", "inflight_s", "last_op",
                  "last_count", "last_dtype")


@dataclass(frozen=True, slots=True)
class HangFinding:
    comm_id: int
    stalled_s: float
    threshold_s: float
    inflight_ranks: tuple[int, ...]
    members: tuple[int, ...]  # every rank with a counter row on the communicator


@dataclass
class _Comm:
    rows: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # rank -> latest row
    sampled_s: float = 0.0
    completed: int = -1
    longest_wait_s: float = 0.0  # longest time inside NCCL seen since completed last moved
    alarmed: bool = False


@dataclass
class JobHangMonitor:
    floor_s: float = 60.0
    multiple: float = 20.0
    stale_s: float = 10.0
    policy: HangPolicy = field(init=False)
    comms: dict[int, _Comm] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.policy = HangPolicy(floor_s=self.floor_s, multiple=self.multiple)

    def observe_iteration(self, duration_s: float) -> None:
        self.policy.observe_iteration(duration_s)

    def observe_counters(self, sampled_s: float, columns: dict[str, list[Any]]) -> None:
        """One agent's sample: columnar rows (COUNTER_FIELDS) of its ranks' communicators."""
        rows = list(zip(*(columns[f] for f in COUNTER_FIELDS), strict=True))
        touched: set[int] = set()
        for row in rows:
            comm_id = int(row[1])
            comm = self.comms.get(comm_id)
            if comm is None:
                comm = self.comms[comm_id] = _Comm()
            comm.rows[int(row[0])] = row
            comm.sampled_s = max(comm.sampled_s, sampled_s)
            touched.add(comm_id)
        for comm_id in touched:
            comm = self.comms[comm_id]
            completed = sum(int(r[5]) for r in comm.rows.values())
            waiting = max(float(r[8]) for r in comm.rows.values())
            if completed > comm.completed:
                if comm.completed >= 0 and (
                        comm.alarmed or comm.longest_wait_s > self.multiple * self.policy.typical_s()):
                    # It came back: whatever that was, the job survives waits this long.
                    self.policy.observe_recovered_pause(comm.longest_wait_s)
                comm.completed, comm.longest_wait_s, comm.alarmed = completed, waiting, False
            else:
                comm.longest_wait_s = max(comm.longest_wait_s, waiting)

    def check(self, now_s: float) -> list[HangFinding]:
        out: list[HangFinding] = []
        threshold = self.policy.threshold_s()
        for comm_id, comm in self.comms.items():
            if comm.alarmed or now_s - comm.sampled_s > self.stale_s:
                continue
            waits = {r: float(row[8]) for r, row in comm.rows.items() if float(row[8]) > 0.0}
            if not waits or max(waits.values()) <= threshold:
                continue
            comm.alarmed = True
            out.append(HangFinding(
                comm_id=comm_id, stalled_s=max(waits.values()), threshold_s=threshold,
                inflight_ranks=tuple(sorted(waits)), members=tuple(sorted(comm.rows))))
        return out

    def rows_for(self, findings: list[HangFinding], limit: int = 8192) -> dict[str, list[Any]]:
        """The latest counter rows a diagnosis needs to tell a root cause from its cascade: the
        stalled communicators, every other communicator with a call in flight (the root's own
        call may not be the longest wait: peers that entered the DP all-reduce early have waited
        longer), and the other communicators of all their members (where a rank that never
        entered is idle). Columnar; beyond ``limit`` rows the longest waits are kept."""
        stalled = {f.comm_id for f in findings}
        waits = {cid: max(float(r[8]) for r in comm.rows.values())
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
            picked += [row for row in self.comms[cid].rows.values() if int(row[0]) in ranks]
        rows = sorted(picked[:limit])
        return {f: [r[i] for r in rows] for i, f in enumerate(COUNTER_FIELDS)}

    def state_dict(self) -> dict[str, Any]:
        """What a restarted tracker needs: the learned iteration times and long phases.

        The per-communicator watches are not kept: the next samples rebuild them, and a call
        already stuck inside NCCL reports its own time there, so a hang is still raised.
        """
        policy = self.policy
        return {"floor_s": self.floor_s, "multiple": self.multiple, "stale_s": self.stale_s,
                "recent": list(policy._recent), "long": list(policy._long)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> JobHangMonitor:
        mon = cls(floor_s=float(state["floor_s"]), multiple=float(state["multiple"]),
                  stale_s=float(state["stale_s"]))
        mon.policy._recent.extend(float(x) for x in state["recent"])
        mon.policy._long.extend(float(x) for x in state["long"])
        return mon
