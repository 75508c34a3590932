"""What a detection opens: kind, severity and summary; a hang's first cause by priority."""

from __future__ import annotations

import math

from greyhound.core.hang_diagnosis import HangDiagnosis, HangKind
from greyhound.core.incident_opening import bounded, hang_opening, slowdown_opening


def _d(kind: HangKind, comm: int, ranks: list[int]) -> HangDiagnosis:
    return HangDiagnosis(kind, comm, 9, "allreduce", ranks)


def test_a_rank_that_never_entered_is_named_before_all_entered_none_completes() -> None:
    found = [_d("hang_hardware", -5, [0, 1, 2, 3]), _d("hang_not_entered", 7, [2])]
    o = hang_opening("j", 7, 40.0, 20.0, found, cap=1e6)
    assert (o.kind, o.severity, o.cause, o.others) == ("hang_not_entered", 2.0, found[1],
                                                       [found[0]])
    assert "hang_not_entered on communicator 7 at allreduce #9; ranks [2]" in o.summary
    assert hang_opening("j", 7, 40.0, 20.0, [_d("hang_hardware", -5, [0])], cap=1e6
                        ).summary.startswith(f"job j: hang_hardware on communicator {2**64 - 5}")


def test_undetermined_hangs_and_bounded_severities() -> None:
    o = hang_opening("j", 7, 30.0, None, [], cap=1e6)
    assert (o.kind, o.severity, o.cause) == ("hang", 1.0, None)
    assert o.summary == "job j: communicator 7 made no progress for 30.0s (cause not determined)"
    slow = slowdown_opening("j", "slowdown", 0.5, 0.75, cap=1e6)
    assert slow.severity == 1.5 and slow.summary == "job j slowdown: iteration 0.500s -> 0.750s (1.50x)"
    assert bounded(math.nan, 10.0) == 10.0 and bounded(-1.0, 10.0) == 0.0 and bounded(1e9, 10.0) == 10.0
