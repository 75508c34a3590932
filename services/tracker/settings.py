"""The tracker's knobs: which change-point detector, and when a stalled call is a hang.

The variables keep the names they had when every process read them (``GREYHOUND_DETECTOR``,
``GREYHOUND_HANG_FLOOR_S``, ``GREYHOUND_HANG_MULTIPLE``). The partition settings stay shared
(services.common.settings): the telemetry stream's subjects depend on them.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from greyhound.core.detector import Method


class TrackerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GREYHOUND_", extra="forbid", frozen=True)

    detector: Method = "bocd-v"
    hang_floor_s: float = Field(default=60.0, gt=0, description="never call a hang sooner than this")
    hang_multiple: float = Field(default=20.0, gt=0, description="x the job's typical iteration")
