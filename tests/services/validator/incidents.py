"""A localised slowdown incident and its suspicion, as the analyzer leaves them for the
validator: shared by the claim tests, which need one per job (or several per job, each under a
dedup key of its own)."""

from __future__ import annotations

from services.common.bus.contract import Suspicion
from services.common.db import repository as repo
from services.common.db.documents import Culprit, Empty, Evidence
from services.common.runtime import ServiceContext


async def localized(ctx: ServiceContext, job: str, key: str = "slowdown") -> Suspicion:
    """A localised slowdown of ``job`` on rank 1 (``key`` its dedup key) and its suspicion."""
    async with ctx.db()() as session:
        await repo.touch_job(session, job)
        inc = await repo.open_incident(session, job_id=job, kind="slowdown", dedup_key=key,
                                       severity=1.5, summary="s",
                                       culprit=Culprit(compute_ranks=[1]), evidence=Evidence(),
                                       stage_detail=Empty())
        # a detected incident cannot be validated (greyhound.core.lifecycle)
        await repo.add_timeline(session, inc, "localized", Empty())
        await session.commit()
    return Suspicion(job_id=job, incident_id=inc.id, kind="compute_slow", ranks=[1], comm_ids=[])
