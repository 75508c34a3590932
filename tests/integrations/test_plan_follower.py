"""Adopting S2 plans between iterations: checks, slices, reports; nothing here needs PyTorch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from greyhound.integrations.plan_follower import AppliedPlan, MicrobatchPlan, PlanFollower


def test_slices_cover_the_global_batch_once_for_any_allocation() -> None:
    counts = (1, 7, 3, 5)
    seen: list[int] = []
    for rank in range(4):
        f = PlanFollower(dp_rank=rank, dp_size=4, microbatches=16, source=MicrobatchPlan(1, counts))
        assert f.next_iteration() == counts[rank]
        assert f.gradient_weight == counts[rank] / 16 and f.loss_scale == 1 / 16
        seen += list(f.microbatch_slice())
    assert seen == list(range(16))


def test_even_split_until_a_plan_arrives_and_one_report_per_version() -> None:
    plans: list[dict[str, object] | None] = [None, {"version": 3, "allocation": [2, 6, 4, 4]},
                           {"version": 3, "counts": [2, 6, 4, 4]}, {"version": 4, "counts": [4, 4, 4, 4]}]
    applied: list[AppliedPlan] = []
    f = PlanFollower(dp_rank=1, dp_size=4, microbatches=16, source=lambda: plans.pop(0),
                     on_applied=applied.append)
    assert [f.next_iteration() for _ in range(4)] == [4, 6, 6, 4]
    assert [(a.version, a.iteration, a.counts) for a in applied] == [
        (3, 1, (2, 6, 4, 4)), (4, 3, (4, 4, 4, 4))]
    assert all(a.cost_s >= 0 and a.dp_rank == 1 for a in applied)


@pytest.mark.parametrize(
    ("raw", "message"),
    [({"version": 2, "counts": [4, 4, 4]}, "3 counts for 4"),
     ({"version": 2, "counts": [0, 8, 4, 4]}, ">= 1"),
     ({"version": 2, "counts": [4, 4, 4, 5]}, "sum to 17"),
     ({"version": "x", "counts": [4, 4, 4, 4]}, "version"),
     ({"version": 2}, "counts")],
)
def test_unusable_plans_are_reported_and_the_current_one_kept(raw: dict[str, object], message: str) -> None:
    errors: list[Exception] = []
    f = PlanFollower(dp_rank=0, dp_size=4, microbatches=16, source=lambda: raw,
                     on_error=errors.append)
    assert f.next_iteration() == 4 and f.version is None
    assert len(errors) == 1 and message in str(errors[0])


def test_a_failing_source_or_report_never_reaches_the_training_loop() -> None:
    def broken() -> MicrobatchPlan:
        raise ConnectionError("planner unreachable")

    def bad_report(_: AppliedPlan) -> None:
        raise RuntimeError("report failed")

    errors: list[Exception] = []
    f = PlanFollower(dp_rank=0, dp_size=2, microbatches=4, source=broken, on_error=errors.append)
    assert f.next_iteration() == 2
    g = PlanFollower(dp_rank=0, dp_size=2, microbatches=4, source=MicrobatchPlan(1, (3, 1)),
                     on_applied=bad_report, on_error=errors.append)
    assert g.next_iteration() == 3
    assert [type(e) for e in errors] == [ConnectionError, RuntimeError]


def test_bad_job_shape_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="dp_rank 4"):
        PlanFollower(dp_rank=4, dp_size=4, microbatches=16)
    with pytest.raises(ValueError, match="microbatches 3 < dp_size 4"):
        PlanFollower(dp_rank=0, dp_size=4, microbatches=3)


def test_greyhound_and_the_cores_import_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import greyhound, greyhound.integrations.plan_follower, greyhound.core.microbatch\n"
        "import greyhound.core.consolidate, greyhound.core.escalation, greyhound.core.restart\n"
        "import greyhound.core.role_swap, greyhound.plan_cli\n"
        "import greyhound.integrations.topology, greyhound.integrations.rest\n"
        "for m in ('torch', 'torch_layout', 'torch_state', 'torch_groups', 'megatron'):\n"
        "    try:\n        __import__('greyhound.integrations.' + m)\n"
        "    except ImportError:\n        print('no torch: ok')\n"
        "banned = [m for m in ('nats', 'sqlalchemy', 'fastapi', 'torch') if sys.modules.get(m)]\n"
        "assert not banned, banned\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["no", "torch:", "ok"] * 5
