"""A mitigation plan's lifecycle: the one place that decides what an action does to its status.

A plan is proposed by the planner, decided (approved by an operator or by the strategy's
policy, rejected, or left to expire), then delivered to the job, which reports that it applied
it or could not; a plan in force is reverted once the fail-slow it works around has ended. A
plan overtaken by events before it took effect (its incident closed, the fault ended while it
awaited a decision or its application) is withdrawn. :func:`advance` gives the status after an
action or raises :class:`IllegalPlanTransition`:

* proposed -> approved | rejected | expired | withdrawn;
* approved -> applied | failed | withdrawn (delivered, the job has not confirmed yet);
* applied -> reverted;
* rejected, expired, failed, reverted and withdrawn are final.

Anything else (approving twice, applying a rejected plan, reverting one that never took effect)
is a bug in the caller or a race the caller must answer with a conflict: two operators deciding
at once get one decision and one refusal.
"""

from __future__ import annotations

from typing import Literal, get_args

PlanStatus = Literal["proposed", "approved", "rejected", "expired", "applied", "failed",
                     "reverted", "withdrawn"]
PLAN_STATUSES: tuple[PlanStatus, ...] = get_args(PlanStatus)
PlanAction = Literal["approve", "reject", "expire", "apply", "fail", "revert", "withdraw"]
PLAN_ACTIONS: tuple[PlanAction, ...] = get_args(PlanAction)
PROPOSED: PlanStatus = "proposed"
# A plan whose layout the job runs (or may run: delivered, not confirmed yet).
DELIVERED: frozenset[PlanStatus] = frozenset({"approved", "applied"})
FINAL: frozenset[PlanStatus] = frozenset({"rejected", "expired", "failed", "reverted", "withdrawn"})

_TABLE: dict[tuple[PlanStatus, PlanAction], PlanStatus] = {
    ("proposed", "approve"): "approved",
    ("proposed", "reject"): "rejected",
    ("proposed", "expire"): "expired",
    ("proposed", "withdraw"): "withdrawn",
    ("approved", "apply"): "applied",
    ("approved", "fail"): "failed",
    ("approved", "withdraw"): "withdrawn",
    ("applied", "revert"): "reverted",
}


class IllegalPlanTransition(ValueError):
    """An action the plan's status does not allow (``status``, ``action``)."""

    def __init__(self, status: str, action: str, why: str) -> None:
        super().__init__(f"plan {status}: {action!r} is not allowed ({why})")
        self.status = status
        self.action = action


def _status(value: str) -> PlanStatus:
    for s in PLAN_STATUSES:
        if s == value:
            return s
    raise IllegalPlanTransition(value, "?", f"unknown status; one of {', '.join(PLAN_STATUSES)}")


def advance(status: str, action: str) -> PlanStatus:
    """The plan's status after ``action``."""
    current = _status(status)
    for a in PLAN_ACTIONS:
        if a == action:
            nxt = _TABLE.get((current, a))
            if nxt is None:
                why = "it is final" if current in FINAL else f"{current} does not allow it"
                raise IllegalPlanTransition(status, action, why)
            return nxt
    raise IllegalPlanTransition(status, action, f"unknown action; one of {', '.join(PLAN_ACTIONS)}")


def allows(status: str, action: str) -> bool:
    """Whether ``action`` is legal now (for callers that answer a conflict instead of raising)."""
    try:
        advance(status, action)
    except IllegalPlanTransition:
        return False
    return True
