"""Hang watching for one job, from the agents' counter samples.

A communicator is suspected hung when its members' completed counts stop advancing for longer
than the job's adaptive threshold (HangPolicy) while at least one member sits inside an NCCL call.
The second condition keeps long phases without NCCL (checkpoint saves, evaluation loops) from
alarming at all; the adaptive threshold covers the ones where some ranks wait inside a collective
(a barrier while rank 0 writes). Samples that stop arriving (the job ended, its agent went away)
stop the watch rather than raise a hang: that is a fail-stop, not a hang.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from greyhound.core.hang import HangPolicy, HangWatch

COUNTER_FIELDS = ("rank", "comm_id", "comm_rank", "nranks", "entered", "completed",
                  "last_seq_entered", "last_seq_completed", "inflight_s", "last_op",
                  "last_count", "last_dtype")


@dataclass(frozen=True, slots=True)
class HangFinding:
    comm_id: int
    stalled_s: float
    threshold_s: float
    inflight_ranks: tuple[int, ...]
    rows: dict[str, list[Any]]  # the communicator's latest counter rows, columnar


@dataclass
class _Comm:
    watch: HangWatch
    rows: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # rank -> latest row
    sampled_s: float = 0.0


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
                comm = self.comms[comm_id] = _Comm(HangWatch(self.policy))
            comm.rows[int(row[0])] = row
            comm.sampled_s = max(comm.sampled_s, sampled_s)
            touched.add(comm_id)
        for comm_id in touched:
            comm = self.comms[comm_id]
            completed = sum(int(r[5]) for r in comm.rows.values())
            comm.watch.observe(sampled_s, completed)

    def check(self, now_s: float) -> list[HangFinding]:
        out: list[HangFinding] = []
        for comm_id, comm in self.comms.items():
            if now_s - comm.sampled_s > self.stale_s:
                continue
            inflight = tuple(sorted(r for r, row in comm.rows.items() if float(row[8]) > 0.0))
            if not inflight:
                # Nobody inside NCCL: re-arm, so a stall is measured from the next sample on.
                comm.watch = HangWatch(self.policy)
                continue
            alarm = comm.watch.check(now_s)
            if alarm is None:
                continue
            rows = sorted(comm.rows.values())
            out.append(HangFinding(
                comm_id=comm_id, stalled_s=alarm.stalled_s, threshold_s=alarm.threshold_s,
                inflight_ranks=inflight,
                rows={f: [r[i] for r in rows] for i, f in enumerate(COUNTER_FIELDS)}))
        return out

    def state_dict(self) -> dict[str, Any]:
        """What a restarted tracker needs: the learned iteration times and long phases.

        The per-communicator watches are not kept: samples re-arm them within a second, and a
        stall that began before the restart is then measured from the restart (a late alarm,
        never a false one).
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
