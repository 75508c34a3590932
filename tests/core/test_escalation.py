"""Ski-rental escalation: S2 only once the loss pays for it (compute), S3 for a congested link,
revert on recovery, overheads learned from what plans cost."""

from __future__ import annotations

import pytest

from greyhound.core.escalation import Apply, Escalation, Revert, Strategy

HEALTHY = 1.0
OVERHEADS = {Strategy.MICROBATCH: 5.0, Strategy.TOPOLOGY: 60.0, Strategy.RESTART: 1800.0}


def feed(esc: Escalation, seconds: float, n: int) -> list[tuple[int, object]]:
    return [(i, d) for i in range(n) if (d := esc.observe(seconds)) is not None]


def test_compute_reaches_s2_only_once_the_loss_pays_for_it() -> None:
    esc = Escalation("compute", HEALTHY, OVERHEADS)
    assert esc.ladder == (Strategy.IGNORE, Strategy.MICROBATCH, Strategy.TOPOLOGY, Strategy.RESTART)
    # 1.5 s iterations lose 0.5 s each: S2's 5 s overhead is paid after 10 of them, not before.
    decisions = feed(esc, 1.5, 9)
    assert decisions == [] and esc.strategy is Strategy.IGNORE and esc.loss_s == pytest.approx(4.5)
    decision = esc.observe(1.5)
    assert isinstance(decision, Apply) and decision.strategy is Strategy.MICROBATCH
    assert decision.loss_s == pytest.approx(5.0)
    # Until the plan is confirmed, slow iterations add loss but nothing escalates.
    assert feed(esc, 1.5, 200) == []
    esc.applied(Strategy.MICROBATCH, cost_s=3.0)
    assert esc.overheads[Strategy.MICROBATCH] == pytest.approx(4.0)  # EWMA, alpha 0.5
    # S2 works: iterations within 10% of healthy add no loss and never escalate.
    loss = esc.loss_s
    assert feed(esc, 1.08, 10_000) == [] and esc.loss_s == loss
    revert = esc.recovered()
    assert revert == Revert(Strategy.MICROBATCH, revert.reason if revert else "")
    assert esc.closed and esc.observe(5.0) is None


def test_short_fail_slow_is_ignored_entirely() -> None:
    esc = Escalation("compute", HEALTHY, OVERHEADS)
    assert feed(esc, 1.3, 10) == []  # 3 s of loss < 5 s
    assert esc.recovered() is None  # S1: nothing to revert


def test_communication_skips_s2_and_reaches_s3_when_the_loss_reaches_its_overhead() -> None:
    esc = Escalation("communication", HEALTHY, OVERHEADS)
    assert Strategy.MICROBATCH not in esc.ladder
    decisions = feed(esc, 1.6, 200)  # 0.6 s per iteration: 60 s after 100 iterations
    assert len(decisions) == 1
    index, decision = decisions[0]
    assert isinstance(decision, Apply) and decision.strategy is Strategy.TOPOLOGY
    assert index == 99
    esc.applied(Strategy.TOPOLOGY, cost_s=40.0)
    assert esc.overheads[Strategy.TOPOLOGY] == pytest.approx(50.0)
    assert feed(esc, 1.0, 100) == []
    revert = esc.recovered()
    assert isinstance(revert, Revert) and revert.strategy is Strategy.TOPOLOGY


def test_compute_escalates_past_s2_when_it_does_not_bring_the_job_back() -> None:
    esc = Escalation("compute", HEALTHY, OVERHEADS)
    feed(esc, 2.0, 5)  # loss 5 s -> S2
    esc.applied(Strategy.MICROBATCH, cost_s=5.0)
    decisions = feed(esc, 1.5, 120)  # S2 only half helps: 0.5 s more per iteration
    assert [d.strategy for _, d in decisions if isinstance(d, Apply)] == [Strategy.TOPOLOGY]
    assert esc.loss_s >= 60.0
    esc.applied(Strategy.TOPOLOGY, cost_s=60.0)
    decisions = feed(esc, 1.5, 4000)  # nothing helps: S4 once 1800 s are lost, never beyond
    assert [d.strategy for _, d in decisions if isinstance(d, Apply)] == [Strategy.RESTART]
    esc.applied(Strategy.RESTART, cost_s=1500.0)
    assert esc.recovered() is None  # a restart has nothing to revert


def test_unavailable_strategies_leave_the_ladder() -> None:
    esc = Escalation("compute", HEALTHY, {Strategy.RESTART: 10.0},
                     available={Strategy.RESTART})
    assert esc.ladder == (Strategy.IGNORE, Strategy.RESTART)
    [(_, decision)] = feed(esc, 3.0, 6)
    assert isinstance(decision, Apply) and decision.strategy is Strategy.RESTART


def test_failed_application_unblocks_the_ladder() -> None:
    esc = Escalation("compute", HEALTHY, OVERHEADS)
    feed(esc, 6.0, 1)
    esc.failed(Strategy.MICROBATCH)
    [(_, decision)] = feed(esc, 6.0, 20)
    assert isinstance(decision, Apply) and decision.strategy is Strategy.TOPOLOGY


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"kind": "disk"}, "kind"), ({"healthy_iteration_s": 0.0}, "positive"),
     ({"overheads_s": {Strategy.TOPOLOGY: 1.0}}, "MICROBATCH"), ({"alpha": 0.0}, "alpha"),
     ({"trust": 0.0}, "trust"), ({"trust": 1.5}, "trust"), ({"expected_s": -1.0}, "expected_s"),
     ({"expected_s": float("inf")}, "expected_s")],
)
def test_bad_configuration_is_a_value_error(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"kind": "compute", "healthy_iteration_s": HEALTHY, "overheads_s": OVERHEADS}
    with pytest.raises(ValueError, match=message):
        Escalation(**(args | kwargs))


def test_applied_checks_what_was_pending() -> None:
    esc = Escalation("compute", HEALTHY, OVERHEADS)
    with pytest.raises(ValueError, match="not awaiting"):
        esc.applied(Strategy.MICROBATCH, 1.0)
    with pytest.raises(ValueError, match="finite"):
        esc.observe(float("nan"))


def test_state_round_trip_goes_on_where_it_stopped() -> None:
    esc = Escalation("compute", HEALTHY, OVERHEADS)
    feed(esc, 1.5, 10)  # S2 pending
    again = Escalation.from_state(esc.state_dict())
    assert again.state_dict() == esc.state_dict()
    assert again.pending is Strategy.MICROBATCH and again.loss_s == pytest.approx(5.0)
    again.applied(Strategy.MICROBATCH, cost_s=1.0)
    esc.applied(Strategy.MICROBATCH, cost_s=1.0)
    assert feed(again, 1.5, 200) == feed(esc, 1.5, 200)
    with pytest.raises(ValueError, match="not an escalation state"):
        Escalation.from_state({"kind": "compute"})
    bad = {**esc.state_dict(), "step": 7}
    with pytest.raises(ValueError, match="step"):
        Escalation.from_state(bad)


def test_a_congestion_predicted_to_last_buys_s3_at_trust_times_its_overhead() -> None:
    """Learning-augmented ski rental: a congestion expected to last 24 minutes (the field
    study's mean) outlasts the 100 s break-even of a 60 s S3 at 0.6 s per second lost, so S3
    comes at 0.5 x 60 s of loss, after 50 iterations instead of 100."""
    esc = Escalation("communication", HEALTHY, OVERHEADS, expected_s=1440.0, trust=0.5)
    [(index, decision)] = feed(esc, 1.6, 200)
    assert isinstance(decision, Apply) and decision.strategy is Strategy.TOPOLOGY
    assert index == 49 and decision.loss_s == pytest.approx(30.0) and decision.threshold_s == 30.0
    assert "0.5 x TOPOLOGY's overhead 60.0 s" in decision.reason and "1440 s" in decision.reason


def test_a_fault_predicted_to_end_before_the_break_even_waits_for_overhead_over_trust() -> None:
    # expected to last 100 s: losing 0.5 s per 1.5 s iteration (1/3 s per second), 60 s are
    # lost only after 180 s, so S3 waits for 60 / 0.5 = 120 s of loss (240 iterations), even
    # past the break-even: a fault that outlasts the prediction costs at most (1 + 1/trust)
    # x the optimum
    esc = Escalation("communication", HEALTHY, OVERHEADS, expected_s=100.0, trust=0.5)
    [(index, decision)] = feed(esc, 1.5, 400)
    assert isinstance(decision, Apply) and index == 239
    assert decision.loss_s == pytest.approx(120.0) and decision.threshold_s == 120.0
    assert "before the break-even" in decision.reason


@pytest.mark.parametrize("kwargs", [{"trust": 1.0, "expected_s": 1440.0}, {"trust": 0.5}])
def test_full_trust_or_no_prediction_is_the_published_break_even(kwargs: dict[str, float]) -> None:
    esc = Escalation("communication", HEALTHY, OVERHEADS, **kwargs)
    [(index, decision)] = feed(esc, 1.6, 200)
    assert index == 99 and isinstance(decision, Apply) and "expected" not in decision.reason
    assert decision.threshold_s == decision.overhead_s == 60.0


def test_a_restored_escalation_keeps_its_prediction() -> None:
    esc = Escalation("communication", HEALTHY, OVERHEADS, expected_s=1440.0, trust=0.5)
    feed(esc, 1.6, 30)
    again = Escalation.from_state(esc.state_dict())
    assert again.state_dict() == esc.state_dict()
    assert feed(again, 1.6, 30) == feed(esc, 1.6, 30) != []
    old = {k: v for k, v in esc.state_dict().items()
           if k not in ("expected_s", "trust")}  # written before there were predictions
    assert Escalation.from_state(old).trust == 1.0
