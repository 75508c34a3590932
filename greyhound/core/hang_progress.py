"""CCL-D's hang diagnosis sharpened by kernel-level progress counters (greyhound.core.progress).

``diagnose_hang`` reads per-communicator counters: which collective each rank entered and whether
its GPU finished it. When every rank entered the same collective and none finished it (H3, every
rank stuck), those counters name everyone. The progress counters of that communicator say where
inside the collective each rank stopped: such a diagnosis then names the rank that stopped first
(the sender of the link with the fewest steps done on each stalled channel) and carries the
links and channels as evidence. Any other diagnosis whose communicator has stuck steps gets the
same evidence (``inside_links``, ``inside_channels``, ``first_stopped_rank``), unchanged
otherwise. Without progress rows (no plugin, intra-node only) nothing
changes.
"""

from __future__ import annotations

from dataclasses import replace

from greyhound.core.hang_diagnosis import HangDiagnosis
from greyhound.core.progress import ProgressSample, inside_collective


def refine_with_progress(found: list[HangDiagnosis], sample: ProgressSample | None, *,
                         stall_s: float) -> list[HangDiagnosis]:
    """``found`` with each diagnosis's communicator looked inside: an unlocalised hang_hardware
    (every member pending) names the rank that stopped first; every diagnosis with stuck steps
    gets the ``inside_*`` and ``first_stopped_*`` evidence."""
    if sample is None or len(sample) == 0:
        return found
    out: list[HangDiagnosis] = []
    for d in found:
        inside = inside_collective(sample, d.comm_id, stall_s=stall_s)
        if inside is None:
            out.append(d)
            continue
        ev = {**d.evidence, **inside.evidence()}
        everyone = d.kind == "hang_hardware" and not d.evidence.get("localized", 1)
        if everyone and inside.first_rank >= 0:
            ev.update(localized=1, localized_by="progress", all_pending_ranks=list[object](d.ranks))
            out.append(replace(d, ranks=[inside.first_rank], evidence=ev))
        else:
            out.append(replace(d, evidence=ev))
    return out
