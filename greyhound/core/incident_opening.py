"""What a detection opens (pure): its incident's kind, severity and summary, and for a hang the
cause to name first among what CCL-D's diagnosis found (greyhound.core.hang_diagnosis).

A slowdown's severity is its slowdown; a hang's, how far past its threshold it stalled. Of a
hang's diagnoses (the cascaded symptoms already dropped by the diagnosis), a rank that never
entered (or entered something else) explains peers stuck in the collective after it, so those
causes are named before "all entered, none completes"; the rest are the hang's further stalled
communicators. With no diagnosis, the hang's cause is not determined.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from greyhound.core.hang_diagnosis import HangDiagnosis
from greyhound.hookabi import unsigned64

HANG_PRIORITY = {"hang_not_entered": 0, "hang_inconsistent": 1, "hang_hardware": 2}
UNDETERMINED = "hang"


@dataclass(frozen=True)
class Opening:
    kind: str
    severity: float
    summary: str
    cause: HangDiagnosis | None = None  # a hang's first cause
    others: list[HangDiagnosis] = field(default_factory=list)  # and what else is stalled


def bounded(x: float, cap: float) -> float:
    """A severity as records take it: finite, 0..cap (NaN is the cap)."""
    return min(max(x, 0.0), cap) if x == x else cap


def slowdown_opening(job: str, kind: str, before_s: float, after_s: float, *,
                     cap: float) -> Opening:
    summary = (f"job {job} {kind}: iteration {before_s:.3f}s -> {after_s:.3f}s "
               f"({after_s / before_s:.2f}x)")
    return Opening(kind, bounded(after_s / before_s, cap), summary)


def hang_opening(job: str, comm_id: int | None, stalled_s: float, threshold_s: float | None,
                 found: Sequence[HangDiagnosis], *, cap: float) -> Opening:
    severity = bounded(stalled_s / threshold_s if threshold_s else 1.0, cap)
    mine = sorted(found, key=lambda d: HANG_PRIORITY.get(d.kind, len(HANG_PRIORITY)))
    if not mine:
        return Opening(UNDETERMINED, severity, (
            f"job {job}: communicator {comm_id} made no progress for {stalled_s:.1f}s "
            "(cause not determined)"))
    d = mine[0]
    return Opening(d.kind, severity, (
        f"job {job}: {d.kind} on communicator {unsigned64(d.comm_id)} at {d.op} #{d.seq}; "
        f"ranks {d.ranks[:16]}; stalled {stalled_s:.1f}s"), d, mine[1:16])
