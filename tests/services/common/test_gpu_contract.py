"""The GPU health contract: its subject carries the job (so telemetry filters and partitions by
it), the telemetry stream stores it, and its fields are bounded."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.common.bus.contract import (
    MAX_GPUS,
    ControlReply,
    ControlRequest,
    GpuHealth,
    GpuSample,
    Subjects,
    XidEvent,
)
from services.common.bus.streams import TELEMETRY, stream_configs
from services.common.settings import Settings


def test_subject_is_per_job_and_agent_and_stored_as_telemetry() -> None:
    subject = Subjects.gpu_health("job-1", "node-2")
    assert subject == "gh.v1.job-1.gpu.node-2"
    assert Subjects.job_of(subject) == "job-1"
    assert Subjects.in_partition(Subjects.ALL_GPU_HEALTH, 3) == "gh.v1.*.gpu.*.3"
    assert Subjects.agent_of(subject) == "node-2" == Subjects.agent_of(f"{subject}.3")
    telemetry = next(c for c in stream_configs(Settings()) if c.name == TELEMETRY)
    assert telemetry.subjects is not None and Subjects.ALL_GPU_HEALTH in telemetry.subjects
    with pytest.raises(ValueError):
        Subjects.gpu_health("bad job", "a")


def test_fields_are_bounded_and_absent_means_none() -> None:
    g = GpuSample(index=0, host="h")
    assert g.sm_clock_mhz is None and g.power_w is None and g.nvlink_errors is None
    GpuHealth(job_id="j", agent_id="a", sampled_ns=1, gpus=[g] * MAX_GPUS)
    with pytest.raises(ValidationError):
        GpuHealth(job_id="j", agent_id="a", sampled_ns=1, gpus=[g] * (MAX_GPUS + 1))
    with pytest.raises(ValidationError):
        GpuSample(index=0, host="h", xids=[XidEvent(code=79, ts=0.0)] * 17)
    with pytest.raises(ValidationError):
        GpuSample(index=0, host="h", throttle=["x"] * 17)
    with pytest.raises(ValidationError):
        GpuSample(index=-1, host="h")


def test_gpu_is_a_control_action_with_samples_in_the_reply() -> None:
    req = ControlRequest(job_id="j", action="gpu", ranks=[2])
    assert ControlRequest.model_validate_json(req.model_dump_json()) == req
    reply = ControlReply(ok=True, agent_id="a", gpus=[GpuSample(index=2, host="h", ranks=[2])])
    assert ControlReply.model_validate_json(reply.model_dump_json()).gpus[0].ranks == [2]
