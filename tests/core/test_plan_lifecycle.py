"""The plan lifecycle, every (status, action) pair: the legal ones give the status written here,
by hand, and every other one raises IllegalPlanTransition."""

from __future__ import annotations

import itertools

import pytest

from greyhound.core.plan_lifecycle import (
    DELIVERED,
    FINAL,
    PLAN_ACTIONS,
    PLAN_STATUSES,
    IllegalPlanTransition,
    advance,
    allows,
)

# (status before, action) -> status after; a pair missing here is illegal.
LEGAL = {
    ("proposed", "approve"): "approved",  # an operator, or the strategy's policy
    ("proposed", "reject"): "rejected",
    ("proposed", "expire"): "expired",  # nobody decided within the TTL
    ("proposed", "withdraw"): "withdrawn",  # the fault ended before a decision
    ("approved", "apply"): "applied",  # the job reported it runs the plan
    ("approved", "fail"): "failed",  # the job could not apply it
    ("approved", "withdraw"): "withdrawn",  # delivered, but the fault ended first
    ("applied", "revert"): "reverted",  # the fault ended: back to the job's own layout
}


@pytest.mark.parametrize(("status", "action"), list(itertools.product(PLAN_STATUSES, PLAN_ACTIONS)))
def test_every_pair(status: str, action: str) -> None:
    if (status, action) in LEGAL:
        assert advance(status, action) == LEGAL[(status, action)]
        assert allows(status, action)
    else:
        with pytest.raises(IllegalPlanTransition) as err:
            advance(status, action)
        assert (err.value.status, err.value.action) == (status, action)
        assert status in str(err.value) and action in str(err.value)
        assert not allows(status, action)


def test_final_statuses_allow_nothing_and_the_rest_lead_somewhere() -> None:
    assert {"rejected", "expired", "failed", "reverted", "withdrawn"} == FINAL
    assert {"approved", "applied"} == DELIVERED
    for status in PLAN_STATUSES:
        leads = {a for a in PLAN_ACTIONS if allows(status, a)}
        assert (not leads) == (status in FINAL), status
    with pytest.raises(IllegalPlanTransition, match="final"):
        advance("rejected", "approve")


def test_unknown_names_are_refused() -> None:
    with pytest.raises(IllegalPlanTransition, match="unknown"):
        advance("proposed", "cancel")
    with pytest.raises(IllegalPlanTransition, match="unknown"):
        advance("draft", "approve")
