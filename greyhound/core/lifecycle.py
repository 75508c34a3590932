"""An incident's lifecycle: the one place that decides what a timeline entry does to its status.

Every stage a service records (a detection, a localisation, a validation, a mitigation, a
recovery) is a timeline entry; :func:`advance` says which status the incident has after it, or
raises :class:`IllegalTransition`. The rules:

* forward one step at a time: detected -> localized -> validated -> mitigated;
* resolved from any open status: the tracker saw the job recover, or the analyzer found the
  slowdown over before it was localised (closed as transient);
* the same stage again stays (a second localisation adds to the first, a second validation or
  mitigation step follows the first);
* a ``detected`` entry is a note (a further detection of the open problem): the status stays;
  so is ``acknowledged`` (an operator took the incident), which only an open incident takes;
* a plan's steps (``plan_proposed``, ``plan_approved``, ``plan_rejected``, ``plan_expired``,
  ``plan_failed``, ``plan_withdrawn``, ``plan_applied``, ``plan_reverted``) are notes at any
  status, a closed incident included: its plan is reverted after the fault ended, and a report
  may arrive after the recovery. Applying a plan to an open validated incident is the
  ``mitigated`` entry itself; ``plan_applied`` records one that cannot move the status;
* a validation of a mitigated incident (the planner asking whether the fault is still there)
  leaves it mitigated;
* a new localisation supersedes what followed the old one: validated and mitigated go back to
  localized (the job slowed again; the escalation starts over from the new evidence);
* results that arrive after the incident was resolved (a localisation or validation still
  running at recovery, a late detection) are recorded and the incident stays resolved.

Anything else (skipping a step, validating or mitigating a closed incident, closing it twice)
is a bug in the caller. A validation that finds nothing slow is recorded as ``validated`` with
a transient verdict and the incident stays open: only a recovery proves the slowdown is over.
"""

from __future__ import annotations

from typing import Literal, get_args

Status = Literal["detected", "localized", "validated", "mitigated", "resolved"]
STATUSES: tuple[Status, ...] = get_args(Status)
Note = Literal["acknowledged", "plan_proposed", "plan_approved", "plan_rejected", "plan_expired",
               "plan_failed", "plan_withdrawn", "plan_applied", "plan_reverted"]
# timeline stages that are never a status
PLAN_NOTES: frozenset[str] = frozenset(n for n in get_args(Note) if n.startswith("plan_"))
Stage = Status | Note
STAGES: tuple[Stage, ...] = (*STATUSES, *get_args(Note))
OPENED: Status = "detected"
OPEN: frozenset[Status] = frozenset({"detected", "localized", "validated", "mitigated"})

_FORWARD: dict[Status, Status] = {
    "detected": "localized", "localized": "validated", "validated": "mitigated"}
_LATE_ON_RESOLVED: frozenset[Status] = frozenset({"detected", "localized", "validated"})


class IllegalTransition(ValueError):
    """A timeline entry the incident's status does not allow (``status``, ``stage``)."""

    def __init__(self, status: str, stage: str, why: str) -> None:
        super().__init__(f"incident {status}: a {stage!r} entry is not allowed ({why})")
        self.status = status
        self.stage = stage


def _known(value: str) -> Status:
    for s in STATUSES:
        if s == value:
            return s
    raise IllegalTransition(value, value, f"unknown status; one of {', '.join(STATUSES)}")


def advance(status: str, stage: str) -> Status:
    """The incident's status after a timeline entry of ``stage``."""
    current = _known(status)
    if stage not in STAGES:
        raise IllegalTransition(status, stage, f"unknown stage; one of {', '.join(STAGES)}")
    if stage == "acknowledged":
        if current == "resolved":
            raise IllegalTransition(status, stage, "the incident is closed")
        return current
    if stage in PLAN_NOTES:
        return current
    entry = _known(stage)
    if current == "resolved":
        if entry in _LATE_ON_RESOLVED:
            return "resolved"
        raise IllegalTransition(status, stage, "the incident is closed")
    if entry == "resolved" or entry == current or _FORWARD.get(current) == entry:
        return entry
    if entry == "detected" or (current, entry) == ("mitigated", "validated"):
        return current
    if entry == "localized":  # validated or mitigated: localised again
        return "localized"
    raise IllegalTransition(status, stage, f"{current} does not lead to {entry}")


def is_open(status: str) -> bool:
    return _known(status) in OPEN
