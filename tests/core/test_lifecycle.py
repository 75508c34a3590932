"""The incident lifecycle, every (status, stage) pair: the legal ones give the status written
here, by hand, and every other one raises IllegalTransition."""

from __future__ import annotations

import itertools

import pytest

from greyhound.core.lifecycle import (
    OPEN,
    PLAN_NOTES,
    STAGES,
    STATUSES,
    IllegalTransition,
    advance,
    is_open,
)

# (status before, timeline stage) -> status after; a pair missing here is illegal.
LEGAL = {
    ("detected", "detected"): "detected",  # a further detection of the open problem
    ("detected", "localized"): "localized",
    ("detected", "resolved"): "resolved",  # recovery, or over before it was localised
    ("localized", "detected"): "localized",
    ("localized", "localized"): "localized",  # a repeated localisation adds to the first
    ("localized", "validated"): "validated",
    ("localized", "resolved"): "resolved",
    ("validated", "detected"): "validated",
    ("validated", "localized"): "localized",  # the job slowed again: new evidence
    ("validated", "validated"): "validated",
    ("validated", "mitigated"): "mitigated",
    ("validated", "resolved"): "resolved",
    ("mitigated", "detected"): "mitigated",
    ("mitigated", "validated"): "mitigated",  # the planner re-checks the culprit under a plan
    ("mitigated", "localized"): "localized",  # still slow after the mitigation: start over
    ("mitigated", "mitigated"): "mitigated",  # the next step of an escalation
    ("mitigated", "resolved"): "resolved",
    ("resolved", "detected"): "resolved",  # late results are recorded, the incident stays closed
    ("resolved", "localized"): "resolved",
    ("resolved", "validated"): "resolved",
    # an operator's acknowledgement is a note on an open incident
    ("detected", "acknowledged"): "detected",
    ("localized", "acknowledged"): "localized",
    ("validated", "acknowledged"): "validated",
    ("mitigated", "acknowledged"): "mitigated",
}
# a plan's steps are notes at every status, a closed incident included (reverts come after it)
LEGAL.update({(status, note): status for status in STATUSES for note in PLAN_NOTES})


@pytest.mark.parametrize(("status", "stage"), list(itertools.product(STATUSES, STAGES)))
def test_every_pair_of_states(status: str, stage: str) -> None:
    if (status, stage) in LEGAL:
        assert advance(status, stage) == LEGAL[(status, stage)]
    else:
        with pytest.raises(IllegalTransition) as err:
            advance(status, stage)
        assert (err.value.status, err.value.stage) == (status, stage)
        assert status in str(err.value) and stage in str(err.value)


def test_the_table_covers_the_chain_and_some_pairs_are_illegal() -> None:
    assert STATUSES == ("detected", "localized", "validated", "mitigated", "resolved")
    assert (*STATUSES, "acknowledged", *sorted(PLAN_NOTES, key=STAGES.index)) == STAGES
    notes = {"plan_proposed", "plan_approved", "plan_rejected", "plan_expired", "plan_failed",
             "plan_withdrawn", "plan_applied", "plan_reverted"}
    assert notes == PLAN_NOTES
    illegal = set(itertools.product(STATUSES, STAGES)) - set(LEGAL)
    assert {("detected", "validated"), ("localized", "mitigated"), ("resolved", "resolved"),
            ("resolved", "mitigated"), ("detected", "mitigated"),
            ("resolved", "acknowledged")} <= illegal


def test_unknown_names_are_refused() -> None:
    with pytest.raises(IllegalTransition, match="unknown"):
        advance("detected", "closed")
    with pytest.raises(IllegalTransition, match="unknown"):
        advance("open", "detected")
    with pytest.raises(IllegalTransition):
        is_open("gone")


def test_open_statuses() -> None:
    assert {s for s in STATUSES if is_open(s)} == OPEN == set(STATUSES) - {"resolved"}
