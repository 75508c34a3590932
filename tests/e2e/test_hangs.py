"""Hangs injected with the fake NCCL raise a hang incident within 2x the hang threshold, named
with CCL-D's cause; a long checkpoint phase does not."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from stack.up import Stack
from tests.e2e.conftest import HANG_FLOOR_S, fake_job, incidents, wait_incident

# 40 ms iterations x 20 is under the floor, so the threshold is the floor.
THRESHOLD_S = HANG_FLOOR_S


@pytest.mark.parametrize(("fault", "kind", "rank"), [
    ("skip_call 2 120", "hang_not_entered", 2),
    ("never_complete 1 120", "hang_hardware", 1),
    ("mismatch 3 120", "hang_inconsistent", 3),
])
def test_injected_hang_is_raised_in_time(stack: Stack, tmp_path: Path, fault: str, kind: str,
                                         rank: int) -> None:
    job = f"hang-{uuid.uuid4().hex[:6]}"
    with fake_job(stack, tmp_path, job, iters=400) as fj:
        fj.wait_iteration(0, 60, timeout=60)
        fj.faults.set(fault)
        fj.wait_iteration(0, 119, timeout=30)
        t_hang = time.monotonic()
        incident, _ = wait_incident(stack, job, timeout_s=4 * THRESHOLD_S + 10, kind_prefix="hang")
        elapsed = time.monotonic() - t_hang
        fj.kill()
    assert incident is not None, f"no hang incident for {fault!r}"
    # The job stops progressing at iteration ~120, a few tens of ms after t_hang.
    assert elapsed <= 2 * THRESHOLD_S + 1.0, f"hang raised after {elapsed:.1f}s"
    assert incident["kind"] == kind, incident
    assert incident["culprit"]["ranks"] == [rank], incident["culprit"]


def test_long_checkpoint_is_not_a_hang(stack: Stack, tmp_path: Path) -> None:
    job = f"ckpt-{uuid.uuid4().hex[:6]}"
    # Every 60 iterations a 3 s checkpoint with no NCCL call: longer than the hang threshold.
    with fake_job(stack, tmp_path, job, iters=200, ckpt_every=60, ckpt_ms=3000.0) as fj:
        assert fj.wait(timeout=120) == [0, 0, 0, 0]
    time.sleep(2.0)
    assert [i["kind"] for i in incidents(stack, job) if i["kind"].startswith("hang")] == []
