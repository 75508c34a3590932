"""``greyhound demo --fault slow|link|hang`` on the shared e2e stack: each fault played over the
asynchronous fake through hook, agent, NATS, tracker, analyzer, validator, Postgres and API, and
judged from the RESULT line the demo prints last.

Host time inside NCCL: the hook's records say how long each host call took. On the asynchronous
fake a call only enqueues its work, so most calls take tens of microseconds: the median must stay
under 1 ms. The tail is the machine's, not NCCL's: on a busy 2-core CI machine a preempted call
took 1.76 ms at the 99th percentile (CI, 620 calls), so the p99 bound is 5 ms. Both are far below
what a synchronous NCCL would show on the host: the healthy 32 MB all-reduce takes ~5 ms on the
GPU (every call, so the median), the slow GPU makes its peers wait 0.5 x 40 ms = 20 ms at every
all-reduce, the slow link stretches the all-reduce to ~19 ms, and the hung collective stays
pending for the whole hang floor (2 s here); half the calls come after the fault, so such a p99
is 19 ms or more. So an NCCL timed on the host fails this test, and the incident must come from
the GPU timeline.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from stack.demo import play, report
from stack.demo_faults import FaultKind, make_fault
from stack.up import Stack
from tests.e2e.conftest import HANG_FLOOR_S

HOST_MS_MEDIAN_BOUND = 1.0
HOST_MS_P99_BOUND = 5.0
GPU_MS_AT_LEAST = 10.0  # what the slow GPU and the slow link cost each iteration on the GPU


def _result(text: str) -> dict[str, Any]:
    last = text.strip().splitlines()[-1]
    assert last.startswith("RESULT "), text[-2000:]
    out: dict[str, Any] = json.loads(last.removeprefix("RESULT "))
    return out


@pytest.mark.parametrize(("fault", "kind", "ranks", "links"), [
    ("slow", "compute_slow", [2], []),
    ("link", "comm_slow", [1, 2], [[1, 2]]),
    ("hang", "hang_hardware", [2], []),
])
def test_demo_names_the_fault(stack: Stack, capsys: pytest.CaptureFixture[str], fault: FaultKind,
                              kind: str, ranks: list[int], links: list[list[int]]) -> None:
    chosen = make_fault(fault)
    res = play(stack, chosen, at=80, timeout_s=60.0,
               hang_floor_s=HANG_FLOOR_S if fault == "hang" else None)
    rc = report(res, chosen)
    out = capsys.readouterr().out
    got = _result(out)
    assert rc == 0, out
    assert (got["fault"], got["kind"], got["ranks"], got["links"]) == (fault, kind, ranks, links), out
    assert got["ok"] is True
    assert got["detected_s"] is not None and got["localized_s"] is not None, out
    assert got["detected_s"] <= got["localized_s"] <= 60.0, out
    # The host's time inside NCCL, over enough calls to mean something, against the GPU's.
    assert got["host_calls"] >= 4 * 80, out
    assert got["host_ms_in_nccl_p50"] < HOST_MS_MEDIAN_BOUND, out
    assert got["host_ms_in_nccl_p99"] < HOST_MS_P99_BOUND, out
    if fault == "hang":
        assert got["validated"] is None
        assert got["detected_s"] >= HANG_FLOOR_S - 0.5, out  # pending on the GPU that long
    else:
        assert got["validated"] == kind, out
        assert got["gpu_ms_in_collectives_p50"] >= GPU_MS_AT_LEAST, out


@pytest.mark.parametrize("fault", ["grouped", "bench-peer-dies"])
def test_demo_validations_never_harm_the_job(stack: Stack, capsys: pytest.CaptureFixture[str],
                                             fault: FaultKind) -> None:
    """``grouped``: the slow GPU of a job whose DP communicator is used only inside groups is
    named and validated (its ranks parked after a group). ``bench-peer-dies``: the validation
    of a slow link loses the second node's agent mid-benchmark; it is abandoned, and the job,
    whose ranks report a 60 s process-group timeout to the workload's model of PyTorch's
    watchdog, keeps training (the second node's ranks resume at their lease's end, a quarter of
    that timeout at most: a lease of minutes would have had the watchdog take the job down)."""
    chosen = make_fault(fault)
    res = play(stack, chosen, at=80, timeout_s=60.0)
    rc = report(res, chosen)
    out = capsys.readouterr().out
    got = _result(out)
    assert rc == 0, out
    kinds = ("compute_slow",) if fault == "grouped" else ("comm_slow", "mixed_slow")
    assert got["kind"] in kinds, out
    assert got["job_alive"] is True and got["job_iterations_after"] >= 20, out
    if fault == "grouped":
        assert got["ranks"] == [2] and got["validated"] == "compute_slow", out
        assert got["validation_outcome"] is None
    else:
        assert got["validation_outcome"].startswith("abandoned"), out
        assert got["validated"] is None
