"""The fleet's drain rule, on hand-made inputs (an incident's cost: tests/core/test_incident_cost.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from greyhound.core.fleet import BlamedGpu, FleetIncident, build_fleet
from greyhound.core.placement import Placement

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)


def _inc(n: int, job: str, *, confirmed: bool, days_ago: float = 1.0, kind: str = "compute_slow",
         **blamed: Any) -> FleetIncident:
    """By default the validator's GPU h1:3 (rank 3)."""
    return FleetIncident(f"i{n}", job, kind, T0 - timedelta(days=days_ago), confirmed,
                         **(blamed or {"gpus": (BlamedGpu(3, "h1", 3),)}))


PLACE = {job: {r: Placement(host=f"h{r // 4}", device=r % 4, node=r // 4) for r in range(8)}
         for job in ("a", "b", "c")}


def _fleet(incidents: list[FleetIncident]) -> dict[str, tuple[str, int, int]]:
    comps = build_fleet(incidents, PLACE, now=T0, window=timedelta(days=7), drain_incidents=3,
                        drain_jobs=2)
    return {f"{c.kind}:{c.id}": (c.advice, c.confirmed, len(c.sightings)) for c in comps}


def test_drain_needs_confirmed_incidents_across_jobs() -> None:
    three_jobs = [_inc(1, "a", confirmed=True), _inc(2, "b", confirmed=True),
                  _inc(3, "b", confirmed=True)]
    assert _fleet(three_jobs) == {"gpu:h1:3": ("drain", 3, 3), "node:h1": ("drain", 3, 3)}
    one_job = [_inc(n, "a", confirmed=True) for n in range(3)]
    assert _fleet(one_job)["gpu:h1:3"] == ("watch", 3, 3)
    suspected = [_inc(1, "a", confirmed=True), _inc(2, "b", confirmed=False),
                 _inc(3, "c", confirmed=False)]
    assert _fleet(suspected)["gpu:h1:3"] == ("watch", 1, 3)
    old = [*three_jobs[:2], _inc(3, "c", confirmed=True, days_ago=8)]
    assert _fleet(old)["gpu:h1:3"] == ("ok", 2, 2)


def test_job_relative_names_map_to_hardware() -> None:
    """Rank 6 of job a and rank 2 of job b ran elsewhere; the analyzer's compute ranks and the
    links between job-relative node numbers both land on host names."""
    links = [_inc(n, job, confirmed=True, kind="comm_slow", links=((0, 1),))
             for n, job in enumerate("abc")]
    compute = [_inc(9, "a", confirmed=False, compute_ranks=(6,)),
               _inc(10, "b", confirmed=False, kind="hang_not_entered", ranks=(2,))]
    fleet = _fleet(links + compute)
    assert fleet["link:h0<->h1"] == ("drain", 3, 3)
    assert fleet["gpu:h1:2"] == ("ok", 0, 1)  # the hang is not charged to hardware
    assert "gpu:h0:2" not in fleet
