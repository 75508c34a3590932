"""Whether a recovery is a plan's doing or the fault's end, and the escalation state's round
trip (pure)."""

from __future__ import annotations

from greyhound.core.escalation import Escalation, Strategy
from greyhound.core.plan_build import Culprit
from greyhound.core.tracked_incident import Tracked, level, recovery_is_the_plans


def test_a_recovery_soon_after_a_plan_or_from_the_pre_plan_level_is_the_plans() -> None:
    common = {"preplan_s": 2.0, "under_plan_s": 1.2, "settle": 20}
    assert recovery_is_the_plans(before_s=2.0, iterations_since=None, unconfirmed=True, **common)
    assert recovery_is_the_plans(before_s=1.2, iterations_since=5, unconfirmed=False, **common)
    # later: the level the recovery left says which
    assert recovery_is_the_plans(before_s=1.9, iterations_since=50, unconfirmed=False, **common)
    assert not recovery_is_the_plans(before_s=1.25, iterations_since=50, unconfirmed=False,
                                     **common)
    # no plan took effect: a recovery is the fault's end
    assert not recovery_is_the_plans(before_s=2.0, iterations_since=None, unconfirmed=False,
                                     **common)
    assert not recovery_is_the_plans(before_s=2.0, preplan_s=None, under_plan_s=1.2,
                                     iterations_since=50, settle=20, unconfirmed=False)


def test_state_round_trip() -> None:
    esc = Escalation("mixed", 1.0, {Strategy.MICROBATCH: 2.0, Strategy.TOPOLOGY: 5.0,
                                    Strategy.RESTART: 9.0})
    esc.observe(3.5)  # S2 pending
    t = Tracked("i1", "j1", esc, Culprit({3: 2.0}, ((0, 4),), 1.7), gpu_of_rank=(1, 0, 2, 3),
                pending_plan="p1", preplan_s=1.7, recovered_under_plan=True)
    again = Tracked.from_state("i1", "j1", t.state())
    assert again.state() == t.state() and not again.dirty
    assert again.esc.pending is Strategy.MICROBATCH and again.culprit == t.culprit
    assert not t.checkable and Tracked("i2", "j1", esc, Culprit({3: 2.0})).checkable
    assert level([1.0, float("nan"), 3.0, 2.0]) == 2.0 and level([]) is None


def test_a_restored_escalation_under_its_plan_judges_a_recovery_as_the_plans() -> None:
    """A planner killed while a plan is in force must not take the recovery that plan brings for
    the fault's end (and revert it at once): restored, the plan took effect where its new watch
    begins, and it keeps the level the job ran at before the plan."""
    esc = Escalation("compute", 1.0, {Strategy.MICROBATCH: 2.0, Strategy.TOPOLOGY: 5.0,
                                      Strategy.RESTART: 9.0})
    t = Tracked("i1", "j1", esc, Culprit({2: 2.0}), applied_count=180, preplan_s=1.5)
    again = Tracked.from_state("i1", "j1", t.state())
    assert again.applied_count == 0 and again.preplan_s == 1.5
    assert recovery_is_the_plans(before_s=1.5, preplan_s=again.preplan_s, under_plan_s=None,
                                 iterations_since=3, settle=20, unconfirmed=False)
    never = Tracked.from_state("i2", "j1", Tracked("i2", "j1", esc, Culprit({2: 2.0})).state())
    assert never.applied_count is None
