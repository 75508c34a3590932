"""Localisation end to end over the fake NCCL: hook -> agent (profile mode on the analyzer's
request) -> collectives -> analyzer -> incident. A late rank is a compute straggler named by
rank; a slow link inside the fake's one world communicator is slow communication, named by
that communicator (the validator's P2P checks name the link itself)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from stack.up import Stack
from tests.e2e.conftest import fake_job, incidents


def wait_localized(stack: Stack, job: str, timeout_s: float) -> dict[str, Any] | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        assert not stack.dead(), f"services died: {stack.dead()}"
        for row in incidents(stack, job):
            if any(e["stage"] == "localized" for e in row.get("timeline") or []):
                return row
        time.sleep(0.2)
    return None


@pytest.mark.parametrize(("faults", "spec", "kind"), [
    (["slow_rank 2 1.5"], {}, "compute_slow"),
    # 32 MB all-reduces: 5 ms of a 25 ms iteration, 20 ms once one ring link is 4x slower
    (["slow_link 1 2 4.0"], {"compute_ms": 20.0, "bytes": 32 << 20}, "comm_slow"),
    # TP2 x DP2: the DP groups {0, 2} and {1, 3} are comparable; the link slows only {1, 3},
    # while rank 0 computes late
    (["slow_rank 0 1.5", "slow_link 1 3 4.0"], {"compute_ms": 20.0, "bytes": 32 << 20, "tp": 2},
     "mixed_slow"),
])
def test_fault_is_localized(stack: Stack, tmp_path: Path, faults: list[str],
                            spec: dict[str, Any], kind: str) -> None:
    job = f"loc-{uuid.uuid4().hex[:6]}"
    with fake_job(stack, tmp_path, job, iters=600, **spec) as fj:
        fj.wait_iteration(2, 100, timeout=60)
        for fault in faults:
            fj.faults.set(fault)
        incident = wait_localized(stack, job, timeout_s=40)
        fj.kill()
    assert incident is not None, f"{faults!r} not localized: {incidents(stack, job)}"
    culprit = incident["culprit"]
    assert incident["kind"] == kind, incident
    if kind == "compute_slow":
        assert culprit["compute_ranks"] == [2], culprit
    elif kind == "comm_slow":
        assert len(culprit["comm_ids"]) == 1 and culprit["ranks"] == [0, 1, 2, 3], culprit
    else:
        assert culprit["compute_ranks"] == [0], culprit
        assert len(culprit["comm_ids"]) == 1 and {1, 3} <= set(culprit["ranks"]), culprit
    assert culprit["nodes"], culprit
