"""A validation's result on its incident, in the caller's unit of work: the ``validation``
evidence (how the job was held, what was timed, the verdict or why there is none, the ranks
timed without completion marks), the confirmed culprit named where the job's ranks ran
(greyhound.core.confirmed_culprit), the timeline entry, and the event to announce."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from greyhound.core.confirmed_culprit import name_culprit
from greyhound.core.placement import Placement
from greyhound.core.verdict import ValidationVerdict
from services.common.bus.contract import IncidentEvent, Suspicion
from services.common.db import repository as repo
from services.common.db.documents import Culprit, Evidence, Gpu, Validation
from services.common.db.models import Rank
from services.validator.hold import Run

log = logging.getLogger(__name__)


async def record(session: AsyncSession, s: Suspicion, ranks: Sequence[Rank],
                  run: Run) -> list[IncidentEvent]:
    """The result on the incident (in the caller's transaction); what to announce."""
    incident = await repo.get_incident_for_update(session, s.incident_id)
    if incident is None:
        log.warning("suspicion %s names unknown incident %s", s.event_id, s.incident_id)
        return []
    facts = _jsonable({"suspicion": s.event_id, "suspected": s.kind,
                       "pause_s": round(run.pause_s, 4), **run.evidence,
                       # the ranks whose benchmark times are host times (no marks)
                       "marks_off_ranks": sorted(r.rank for r in ranks if r.marks_off)})
    if run.verdict is None:
        failed = Validation.model_validate({**facts, "outcome": run.failure})
        incident.evidence = incident.evidence.merged(Evidence(validation=failed))
        log.warning("job %s: validation not done: %s", s.job_id, run.failure)
        return []
    v = run.verdict
    facts.update(_jsonable({"verdict": v.kind, "gpus": v.gpus,
                            "links": [list(x) for x in v.links], **v.evidence}))
    if run.gpu_health is not None:
        facts["gpu_health"] = _jsonable(run.gpu_health)
    detail = Validation.model_validate(facts)
    found = Evidence(validation=detail)
    if run.explanation:
        found = found.model_copy(update={"explanation": run.explanation})
    incident.evidence = incident.evidence.merged(found)
    if await repo.add_timeline(session, incident, "validated", detail) == "resolved":
        log.info("incident %s recovered while it was validated: it stays resolved",
                 incident.id)
    if v.kind == "transient":
        # The checks found nothing slow: the fail-slow may have ended, or its cause is one
        # GEMM and P2P checks cannot reproduce (host-side contention). Only the tracker's
        # recovery resolves an incident, so the analyzer's localisation stands meanwhile.
        log.info("job %s: checks did not reproduce the slowdown", s.job_id)
    else:
        incident.kind = v.kind
        incident.culprit = incident.culprit.merged(culprit(v, ranks))
    return [IncidentEvent(job_id=s.job_id, incident_id=incident.id, stage="validated",
                          kind=incident.kind, severity=incident.severity,
                          summary=incident.summary)]


def culprit(v: ValidationVerdict, ranks: Sequence[Rank]) -> Culprit:
    """What the verdict confirmed, named where the job's ranks ran
    (greyhound.core.confirmed_culprit)."""
    n = name_culprit(v.gpus, v.links, placements(ranks))
    return Culprit(gpus=[Gpu(rank=g.rank, node=g.node, host=g.host, device=g.device)
                         for g in n.gpus],
                   links=n.links, link_ranks=n.link_ranks, slow_ranks=n.slow_ranks,
                   ranks=n.ranks, nodes=n.nodes)


def placements(ranks: Sequence[Rank]) -> dict[int, Placement]:
    return {r.rank: Placement(r.host, r.device, r.node) for r in ranks}


def _jsonable(value: Any) -> Any:
    """JSONB has no NaN or infinity: those become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value
