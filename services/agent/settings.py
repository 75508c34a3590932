"""The node agent's knobs: how often it drains the rings and samples the comm counters."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class AgentSettings(BaseSettings):
    """``GREYHOUND_AGENT_POLL_S``, ``GREYHOUND_AGENT_COUNTERS_S``, ``GREYHOUND_AGENT_RING_GRACE_S``."""

    model_config = SettingsConfigDict(env_prefix="GREYHOUND_AGENT_", extra="forbid", frozen=True)

    poll_s: float = Field(default=0.05, gt=0, description="ring drain and publish period")
    counters_s: float = Field(default=0.5, gt=0, description="comm counter sampling period")
    ring_grace_s: float = Field(default=300.0, gt=0, description=(
        "a ring no live process writes is removed once unchanged this long"))
