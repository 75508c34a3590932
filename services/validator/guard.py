"""Which suspicions may pause a job: only one an open, localised, confirmed incident of that job
stands behind.

A validation parks every rank of a job, so the validator must not act on a Suspicion just
because it arrived: a forged one, a replay under a new event id, one for an incident that
recovered (unless the planner re-checks the GPU under a plan that hid the slowdown), one for a
slowdown only suspected so far (a short transient could still explain it), or one naming
nothing (which would check every GPU) is refused before any agent is asked anything. What the
suspicion names must be what the analyzer localised: its ranks among the incident's
``compute_ranks`` and its communicators among the incident's ``comm_ids``, both committed by
the analyzer before it published the suspicion. Pure: values in, a reason out.
"""

from __future__ import annotations

from collections.abc import Collection

from greyhound.hookabi import MAX_COMMS, unsigned64
from services.common.bus.contract import Suspicion
from services.common.bus.errors import PermanentError
from services.common.db.models import Incident

# Statuses a validation may follow: localised, or validated before (a re-localisation brings a
# validated incident back to localized; a late suspicion of the same cause may still be checked),
# or mitigated (the planner asks whether the GPU under a plan is still slow: a re-check).
VALIDATABLE = frozenset({"localized", "validated", "mitigated"})
# What a planner's re-check of a GPU under a plan may follow besides: an incident the tracker's
# recovery resolved while the plan was in force (the plan hid the slow GPU, it did not end it:
# services.planner.handlers keeps the plan and asks whether the GPU is still slow).
RECHECKABLE = frozenset({"mitigated", "resolved"})
# The analyzer keeps at most this many entries per culprit list; a full list may have lost some.
CULPRIT_CAP = 256


class SuspicionRefused(PermanentError):
    """A suspicion the validator will not act on; dead-lettered with this reason."""


def _listed(values: list[int]) -> set[int] | None:
    """One of the incident's culprit lists as unsigned ints; None when it may be cut short."""
    if len(values) >= CULPRIT_CAP:
        return None
    return {unsigned64(v) for v in values}


def refusal(s: Suspicion, incident: Incident | None, job_ranks: Collection[int]) -> str | None:
    """Why ``s`` must not lead to a pause, or None when it may. ``job_ranks`` are the ranks
    the job has (from the agents' hellos); with none known, nothing can be paused anyway and
    the validation records that itself."""
    if incident is None:
        return f"no incident {s.incident_id}"
    if incident.job_id != s.job_id:
        return f"incident {incident.id} is job {incident.job_id}'s, not {s.job_id}'s"
    if incident.only_suspected:
        return (f"incident {incident.id} is only suspected (a short transient could explain "
                f"it): no pause before it is confirmed")
    recheck = bool(s.evidence.get("recheck")) and incident.status in RECHECKABLE
    if incident.status not in VALIDATABLE and not recheck:
        what = {"detected": "not localised", "resolved": "resolved"}.get(incident.status,
                                                                         incident.status)
        return f"incident {incident.id} is {what}"
    if not s.ranks and not s.comm_ids and not s.slow_groups:
        return "it names no rank and no communicator (that would check every GPU)"
    if len(set(s.ranks)) != len(s.ranks) or len(set(s.comm_ids)) != len(s.comm_ids):
        return "it repeats ranks or communicators"
    if job_ranks:
        strangers = sorted(set(s.ranks) - set(job_ranks))
        if strangers:
            return (f"ranks {strangers[:8]} are not ranks of job {s.job_id} "
                    f"({len(job_ranks)} known)")
        if len(s.slow_groups) > MAX_COMMS * len(job_ranks):
            return f"{len(s.slow_groups)} slow groups is more than the job can have"
    if any(not 0 <= c < 1 << 64 for c in (*s.comm_ids, *s.slow_groups)):
        return "a communicator id is outside 64 bits"
    localised = _listed(incident.culprit.compute_ranks)
    if incident.status == "mitigated" or recheck:
        # A plan may have moved ranks onto other GPUs (a role swap): the re-check names the
        # ranks on the culprit GPU now, which need not be those localised; GEMMs only.
        if s.comm_ids or s.slow_groups:
            return f"a re-check of {incident.status} incident {incident.id} names communicators"
        return None
    if localised is not None and not set(s.ranks) <= localised:
        return (f"ranks {sorted(set(s.ranks) - localised)[:8]} were not localised in incident "
                f"{incident.id}")
    comms = _listed(incident.culprit.comm_ids)
    if comms is not None and not {unsigned64(c) for c in s.comm_ids} <= comms:
        return f"communicators it names were not localised in incident {incident.id}"
    return None
