"""The cost of an incident, level by level, and what a plan saved, on hand-made timelines."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from greyhound.core.incident_cost import TimelinePoint, incident_cost, localization_latency_s
from greyhound.core.incident_kinds import KINDS, matching

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)


def _det(at: datetime, before: float, after: float, first: int = 100, detected: int = 110,
         further: bool = False) -> TimelinePoint:
    return TimelinePoint("detected", at, before_s=before, after_s=after, first_iteration=first,
                         detected_iteration=detected, further=further)


def _s(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


def test_slowdown_cost_from_onset_to_resolution() -> None:
    c = incident_cost(kind="compute_slow", opened_at=T0, resolved_at=T0 + timedelta(hours=1),
                      timeline=[_det(T0, 1.0, 1.25)], gpus=256, now=T0 + timedelta(hours=5))
    # 10 iterations of 1.25 s before the detection; 1 - 1/1.25 = 20% of 256 GPUs lost.
    assert c.onset_at == T0 - _s(12.5)
    assert c.detection_latency_s == pytest.approx(12.5)
    assert c.lost_fraction == pytest.approx(0.2) and c.slowdown == pytest.approx(1.25)
    assert c.gpu_hours_lost == pytest.approx(0.2 * 256 * (3600 + 12.5) / 3600)
    assert not c.ongoing and c.gpu_hours_saved is None and c.mitigated_at is None


def test_a_worsening_counts_from_when_it_began_and_open_incidents_run_to_now() -> None:
    # 1.25x from the onset (12.5 s before T0), then 2x from 20 s before the second detection.
    points = [_det(T0, 1.0, 1.25), _det(T0 + timedelta(minutes=10), 1.0, 2.0)]
    c = incident_cost(kind="slowdown", opened_at=T0, resolved_at=None, timeline=points, gpus=8,
                      now=T0 + timedelta(minutes=30))
    lost = 0.2 * (12.5 + 600 - 20) + 0.5 * (1200 + 20)
    assert c.ongoing and c.duration_s == pytest.approx(1800 + 12.5)
    assert c.gpu_hours_lost == pytest.approx(lost * 8 / 3600)
    assert c.lost_fraction == pytest.approx(lost / 1812.5)
    assert c.slowdown == pytest.approx(2.0) and c.peak_slowdown == pytest.approx(2.0)


def test_a_plan_lowers_the_loss_and_does_not_erase_it() -> None:
    """The issue's incident, in round numbers: healthy 0.4 s, congested 1.2 s (3x) for 100 s,
    a plan brings it to 0.5 s for 60 s until the recovery. The newest detection (the plan's
    speed-up, after_s < before_s) used to set the ratio: 0 GPU-hours."""
    onset = T0 - _s(10 * 1.2)
    applied = T0 + _s(100 - 12)
    timeline = [
        _det(T0, 0.4, 1.2),
        TimelinePoint("mitigated", applied, plan_id="p1", cost_s=2.0),
        # the tracker's partial recovery: 4 iterations of 0.5 s after the plan took effect
        _det(applied + _s(2.0), 1.2, 0.5, first=300, detected=304),
        TimelinePoint("resolved", applied + _s(62.0), before_s=0.5, after_s=0.4),
        TimelinePoint("plan_reverted", applied + _s(70.0), plan_id="p1"),
    ]
    end = applied + _s(62.0)
    c = incident_cost(kind="comm_slow", opened_at=T0, resolved_at=end, timeline=timeline,
                      gpus=16, now=end + timedelta(hours=1))
    slow = 1 - 0.4 / 1.2
    eased = 1 - 0.4 / 0.5
    # the plan took effect at `applied` (its speed-up began 2 s before the partial recovery's
    # record, i.e. at `applied`); 62 s under it to the resolution.
    lost = slow * (applied - onset).total_seconds() + eased * 62.0
    assert c.duration_s == pytest.approx((end - onset).total_seconds())
    assert c.gpu_hours_lost == pytest.approx(lost * 16 / 3600) and c.gpu_hours_lost > 0
    assert c.lost_fraction == pytest.approx(lost / c.duration_s)
    assert c.slowdown == pytest.approx(1.25) and c.peak_slowdown == pytest.approx(3.0)
    assert c.mitigated_at == applied
    # without the plan: the congested level for those 62 s; its 2 s pause cost every GPU.
    assert c.gpu_hours_saved == pytest.approx(((slow - eased) * 62.0 - 2.0) * 16 / 3600)


def test_a_plan_saves_only_while_in_force_and_a_bad_one_saves_less_than_nothing() -> None:
    applied, reverted = T0 + _s(50), T0 + _s(80)
    timeline = [_det(T0, 1.0, 2.0, first=10, detected=10),
                TimelinePoint("plan_applied", applied, plan_id="p", cost_s=5.0),
                _det(applied, 2.0, 2.0, first=1, detected=1),
                TimelinePoint("plan_reverted", reverted, plan_id="p")]
    c = incident_cost(kind="compute_slow", opened_at=T0, resolved_at=T0 + _s(200),
                      timeline=timeline, gpus=3600, now=T0 + _s(300))
    # the plan changed nothing for 30 s and cost a 5 s pause: -5 s of 3600 GPUs = -5 GPU-hours.
    assert c.gpu_hours_saved == pytest.approx(-5.0)
    assert c.gpu_hours_lost == pytest.approx(0.5 * 200)


def test_a_further_fault_is_the_other_incidents_loss() -> None:
    points = [_det(T0, 1.0, 1.5, first=0, detected=0),
              _det(T0 + _s(60), 1.5, 3.0, first=0, detected=0, further=True)]
    c = incident_cost(kind="slowdown", opened_at=T0, resolved_at=T0 + _s(120), timeline=points,
                      gpus=3600, now=T0 + _s(120))
    assert c.gpu_hours_lost == pytest.approx(120 / 3)


def test_hang_loses_everything_since_the_stall_began() -> None:
    c = incident_cost(kind="hang_not_entered", opened_at=T0, resolved_at=T0 + timedelta(minutes=9),
                      timeline=[TimelinePoint("detected", T0, before_s=0.0, after_s=60.0,
                                              first_iteration=-1, detected_iteration=-1)],
                      gpus=64, now=T0)
    assert c.lost_fraction == 1.0 and c.duration_s == pytest.approx(600)
    assert c.gpu_hours_lost == pytest.approx(64 * 600 / 3600)


def test_unknown_size_or_ratio_gives_no_number() -> None:
    c = incident_cost(kind="slowdown", opened_at=T0, resolved_at=None, timeline=[], gpus=None,
                      now=T0 + _s(5))
    assert c.gpu_hours_lost is None and c.lost_fraction is None and c.duration_s == 5
    assert localization_latency_s([TimelinePoint("localized", T0 + _s(7))], T0) == 7


def test_kinds_and_their_prefixes() -> None:
    assert {"slowdown", "compute_slow", "comm_slow", "mixed_slow", "hang", "hang_not_entered",
            "hang_inconsistent", "hang_hardware"} == set(KINDS)
    assert matching("hang*") == ("hang", "hang_not_entered", "hang_inconsistent", "hang_hardware")
    assert matching("comm_slow") == ("comm_slow",)
    assert matching("bogus") == () and matching("bogus*") == ()
