"""The fleet view: GPUs, nodes and links with their incidents across jobs, and drain advice."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Literal

from fastapi import APIRouter

from greyhound.core.fleet import BlamedGpu, FleetIncident, build_fleet, placements_of
from services.api.auth import Viewer
from services.api.deps import ApiSettingsDep, Session, problems
from services.api.schemas import ComponentOut, FleetOut, SightingOut
from services.common.db import repository as repo
from services.common.db.models import Incident

router = APIRouter(prefix="/v1/fleet", tags=["fleet"])


@router.get("", response_model=FleetOut,
            summary="Every GPU, node and link named by recent incidents, worst first",
            description=(
                "Job-relative names are mapped to hardware: a GPU is host:device, a node its "
                "host, a link the pair of its end hosts. Drain rule: at least "
                "GREYHOUND_FLEET_DRAIN_INCIDENTS (3) incidents *confirmed by validation* "
                "(a GEMM or P2P check reproduced the fault) within GREYHOUND_FLEET_WINDOW_DAYS "
                "(7), from at least GREYHOUND_FLEET_DRAIN_JOBS (2) different jobs, so one "
                "job's own trouble does not condemn its hardware. Reaching the count with "
                "unconfirmed (profiling-only) incidents, or within one job, is `watch`. Hangs "
                "are left out: they name software states, not hardware."),
            responses=problems(422))
async def fleet(session: Session, settings: ApiSettingsDep, _: Viewer,
                kind: Literal["gpu", "node", "link"] | None = None,
                advice: Literal["drain", "watch", "ok"] | None = None) -> FleetOut:
    now = datetime.now(UTC)
    window = timedelta(days=settings.fleet_window_days)
    incidents = await repo.incidents_since(session, now - window)
    jobs = sorted({i.job_id for i in incidents})
    ranks = await repo.ranks_of_jobs(session, jobs)
    comps = build_fleet(
        [_blamed(i) for i in incidents],
        placements_of([(r.job_id, r.rank, r.host, r.device, r.node) for r in ranks]),
        now=now, window=window, drain_incidents=settings.fleet_drain_incidents,
        drain_jobs=settings.fleet_drain_jobs)
    out = [ComponentOut(kind=c.kind, id=c.id, host=c.host, device=c.device, advice=c.advice,
                        reason=c.reason, confirmed=c.confirmed, incidents=len(c.sightings),
                        jobs=c.jobs, last_at=c.last_at,
                        history=[SightingOut(incident_id=s.incident_id, job_id=s.job_id,
                                             kind=s.kind, opened_at=s.opened_at,
                                             confirmed=s.confirmed)
                                 for s in sorted(c.sightings, key=lambda s: s.opened_at)])
           for c in comps if (kind is None or c.kind == kind)
           and (advice is None or c.advice == advice)]
    rule = (f">= {settings.fleet_drain_incidents} confirmed incidents in >= "
            f"{settings.fleet_drain_jobs} jobs within {settings.fleet_window_days:g} days")
    return FleetOut(window_days=settings.fleet_window_days, drain_rule=rule, components=out)


def _blamed(inc: Incident) -> FleetIncident:
    """What the incident blames, as the fleet's rule reads it (compute ranks only where the
    analyzer's localisation named them)."""
    c = inc.culprit
    validation = inc.evidence.validation
    return FleetIncident(
        inc.id, inc.job_id, inc.kind, inc.opened_at,
        confirmed=validation is not None and validation.confirmed,
        gpus=tuple(BlamedGpu(g.rank, g.host, g.device) for g in c.gpus),
        compute_ranks=tuple(c.compute_ranks) if "compute_ranks" in c.model_fields_set else None,
        ranks=tuple(c.ranks), links=tuple(c.links),
        nodes=tuple(c.nodes))
