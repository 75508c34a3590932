"""GPU health end to end: the stack's agent reads the fake NVML, whose GPUs follow the same fault
file as the job. A GPU that is thermally throttled (and, as a throttled GPU is, slower) is named
compute_slow with the throttle in its evidence and words; a hang that follows an Xid is
hang_hardware with the Xid."""

from __future__ import annotations

import uuid
from typing import Any

import httpx

from stack.up import Stack
from tests.e2e.conftest import HANG_FLOOR_S, fake_job, gpu_workdir, wait_incident
from tests.e2e.test_localize_fake import wait_localized


def detail(stack: Stack, incident_id: str) -> dict[str, Any]:
    r = httpx.get(f"http://127.0.0.1:{stack.port}/v1/incidents/{incident_id}", timeout=5)
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


def test_throttled_gpu_is_a_compute_straggler_said_in_words(stack: Stack) -> None:
    job = f"therm-{uuid.uuid4().hex[:6]}"
    with fake_job(stack, gpu_workdir(stack), job, iters=600) as fj:
        try:
            fj.wait_iteration(2, 100, timeout=60)
            fj.faults.set("nvml_throttle 2 thermal")
            fj.faults.set("slow_rank 2 1.5")
            incident = wait_localized(stack, job, timeout_s=40)
        finally:
            fj.faults.clear()
            fj.kill()
    assert incident is not None, f"{job} not localized"
    assert incident["kind"] == "compute_slow", incident
    assert incident["culprit"]["compute_ranks"] == [2], incident["culprit"]
    got = detail(stack, incident["id"])
    health = got["evidence"]["gpu_health"]
    assert [(f["kind"], f["index"], f["ranks"]) for f in health["findings"]] == [
        ("throttled", 2, [2])]
    assert health["samples"][0]["throttle"] == ["sw_thermal", "hw_thermal"]
    assert health["gpus_sampled"] == 4  # the job's four GPUs, not the node's eight
    words = got["explanation"]
    assert words.startswith("GPU 2 on ") and "(rank 2) is thermally throttled (SM clock 1095 MHz " in words
    assert "vs 1980 MHz on its peers; 87 C" in words, words
    assert words in got["summary"]


def test_hang_after_an_xid_is_hang_hardware_with_the_xid(stack: Stack) -> None:
    job = f"xid-{uuid.uuid4().hex[:6]}"
    with fake_job(stack, gpu_workdir(stack), job, iters=400) as fj:
        try:
            fj.wait_iteration(0, 60, timeout=60)
            fj.faults.set("nvml_xid 1 79")
            fj.faults.set("never_complete 1 120")
            incident, _ = wait_incident(stack, job, timeout_s=4 * HANG_FLOOR_S + 20,
                                        kind_prefix="hang")
        finally:
            fj.faults.clear()
            fj.kill()
    assert incident is not None, f"no hang incident for {job}"
    assert incident["kind"] == "hang_hardware", incident
    assert incident["culprit"]["ranks"] == [1], incident["culprit"]
    got = detail(stack, incident["id"])
    findings = got["evidence"]["gpu_health"]["findings"]
    assert [(f["kind"], f["index"], f["ranks"]) for f in findings] == [("xid", 1, [1])]
    assert "reported Xid 79 (GPU has fallen off the bus)" in got["explanation"]
    assert got["explanation"] in got["summary"]
