"""The node agent's knobs: how often it drains the rings, samples the comm counters and the GPUs."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class AgentSettings(BaseSettings):
    """``GREYHOUND_AGENT_POLL_S``, ``_COUNTERS_S``, ``_HELLO_S``, ``_RING_GRACE_S``, ``_GPU_S``,
    ``_XID_POLL_S``, ``_NVML``, ``_NVML_LIB``."""

    model_config = SettingsConfigDict(env_prefix="GREYHOUND_AGENT_", extra="forbid", frozen=True)

    poll_s: float = Field(default=0.05, gt=0, description="ring drain and publish period")
    counters_s: float = Field(default=0.5, gt=0, description="comm counter sampling period")
    hello_s: float = Field(default=60.0, gt=0, description=(
        "how often the agent announces its ranks again: the tracker lets another agent take a "
        "rank only once its holder stopped announcing it (GREYHOUND_TRACKER_RANK_TAKEOVER_S)"))
    ring_grace_s: float = Field(default=300.0, gt=0, description=(
        "a ring no live process writes is removed once unchanged this long"))
    gpu_s: float = Field(default=5.0, gt=0, description="GPU health (NVML) sampling period")
    xid_poll_s: float = Field(default=1.0, gt=0, description="how often NVML's Xid events are read")
    nvml: bool = Field(default=True, description="sample GPU health through NVML at all")
    nvml_lib: str | None = Field(default=None, description=(
        "path of the NVML library to load instead of the loader's libnvidia-ml.so.1 (the fake "
        "NVML in tests and demos)"))
