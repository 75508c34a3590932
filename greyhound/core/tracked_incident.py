"""What the planner keeps per incident it escalates, and the judgements made on it (pure).

The escalation itself is greyhound.core.escalation; around it the planner needs the culprit
(in the GPUs it named, since a topology plan moves ranks), the plan awaiting a decision or its
application, how the job ran just before its newest plan took effect, and the state of the
check that the fault is still there. All of it round-trips through JSON (the ``escalations``
table) so that a restarted planner goes on where it stopped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import median
from typing import Any

from greyhound.core.escalation import Escalation, FailSlowKind
from greyhound.core.plan_build import Culprit

# The validator's and analyzer's incident kinds, as the escalation's ladders name them.
KINDS: dict[str, FailSlowKind] = {"compute_slow": "compute", "comm_slow": "communication",
                                  "mixed_slow": "mixed"}


@dataclass
class Tracked:
    incident_id: str
    job_id: str
    esc: Escalation
    culprit: Culprit
    gpu_of_rank: tuple[int, ...] | None = None  # the layout the culprit's ranks were named in
    pending_plan: str | None = None
    # iterations seen when the newest plan took effect; restored, 0: the restarted planner's
    # watch begins with the plan in force, so all it reads is under the plan
    applied_count: int | None = None
    preplan_s: float | None = None  # the iteration time just before it
    recovered_under_plan: bool = False
    resolved: bool = False
    resolved_at: float | None = None  # monotonic, this process
    recheck_id: str | None = None
    recheck_at: float = 0.0
    last_check_at: float = 0.0
    dirty: bool = True
    fed: int = 0  # how many of the job's iterations (IterationSeries.count) it has seen
    # Unix time its fault began, as estimated from its detection: the job's iterations sent
    # before it are another fault's (or healthy) and add nothing to this incident's loss.
    # Not saved: a restored escalation's cursor is past it already.
    onset_ts: float | None = None
    # the last iteration its loss counts, (rank, iteration, the batch's Unix time): a restarted
    # planner reads the job's iterations again from there, none counted twice or lost
    cursor: tuple[int, int, float] | None = None

    def state(self) -> dict[str, Any]:
        return {"escalation": self.esc.state_dict(),
                "culprit": {"gpu_ranks": {str(r): f for r, f in self.culprit.gpu_ranks.items()},
                            "link_ranks": [list(p) for p in self.culprit.link_ranks],
                            "slowdown": self.culprit.slowdown},
                "gpu_of_rank": None if self.gpu_of_rank is None else list(self.gpu_of_rank),
                "pending_plan": self.pending_plan, "preplan_s": self.preplan_s,
                "under_plan": self.applied_count is not None,
                "cursor": None if self.cursor is None else list(self.cursor),
                "recovered_under_plan": self.recovered_under_plan, "resolved": self.resolved}

    @classmethod
    def from_state(cls, incident_id: str, job_id: str, state: dict[str, Any]) -> Tracked:
        c = state["culprit"]
        culprit = Culprit({int(r): float(f) for r, f in c["gpu_ranks"].items()},
                          tuple((int(a), int(b)) for a, b in c["link_ranks"]),
                          float(c["slowdown"]))
        gpus, cursor = state.get("gpu_of_rank"), state.get("cursor")
        return cls(incident_id, job_id, Escalation.from_state(state["escalation"]), culprit,
                   gpu_of_rank=None if gpus is None else tuple(int(g) for g in gpus),
                   pending_plan=state.get("pending_plan"), preplan_s=state.get("preplan_s"),
                   applied_count=0 if state.get("under_plan") else None,
                   cursor=None if cursor is None else (int(cursor[0]), int(cursor[1]),
                                                       float(cursor[2])),
                   recovered_under_plan=bool(state.get("recovered_under_plan")),
                   resolved=bool(state.get("resolved")), dirty=False)

    @property
    def checkable(self) -> bool:
        """Whether the validator can tell that the fault is over: a slow GPU is benchmarked
        where it is; a slow link, once a plan moved traffic off it, is no longer on the
        communicators a validation would time."""
        return bool(self.culprit.gpu_ranks) and not self.culprit.link_ranks


def level(times: list[float]) -> float | None:
    finite = [t for t in times if math.isfinite(t)]
    return median(finite) if finite else None


def recovery_is_the_plans(*, before_s: float, preplan_s: float | None, under_plan_s: float | None,
                          iterations_since: int | None, settle: int, unconfirmed: bool) -> bool:
    """Whether a recovery the tracker reported is the plan's doing rather than the fault's end.

    A plan that is delivered and not confirmed yet, or that took effect fewer than ``settle``
    iterations ago, explains any recovery; later, the level the recovery left (``before_s``)
    tells: the pre-plan slow level means the drop is the plan's, the level under the plan means
    the fault's end took the job below it.
    """
    if unconfirmed:
        return True
    if iterations_since is None:
        return False
    if iterations_since < settle:
        return True
    if preplan_s is None or under_plan_s is None:
        return False
    return abs(before_s - preplan_s) < abs(before_s - under_plan_s)


def another_fault_ended(before_s: float, risen_to: list[float], rel: float = 0.1) -> bool:
    """Whether a recovery fell from a level another fault raised the job to (``risen_to``: the
    slow levels of the faults found since the plan took effect), so that it was that fault's
    end, not the end of the one the plan works around."""
    return any(abs(before_s - level) <= rel * before_s for level in risen_to)
