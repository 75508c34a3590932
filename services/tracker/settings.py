"""The tracker's knobs: which change-point detector, when a stalled call is a hang, and the
bounds on what it keeps.

The variables keep the names they had when every process read them (``GREYHOUND_DETECTOR``,
``GREYHOUND_HANG_FLOOR_S``, ``GREYHOUND_HANG_MULTIPLE``); the newer ones are
``GREYHOUND_TRACKER_<FIELD>``. The partition settings stay shared (services.common.settings):
the telemetry stream's subjects depend on them. Which partition a process consumes is the one
whose lease it holds (services.tracker.ownership).
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from greyhound.core.detector import Method
from services.common.bus.bounds import MAX_RANK


class TrackerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GREYHOUND_", extra="forbid", frozen=True)

    detector: Method = "bocd-v"
    hang_floor_s: float = Field(default=60.0, gt=0, description="never call a hang sooner than this")
    hang_multiple: float = Field(default=20.0, gt=0, description="x the job's typical iteration")
    tracker_max_ranks: int = Field(
        default=131_072, ge=1, le=MAX_RANK,
        description="ranks one job may have; a batch bringing more is dead-lettered")
    tracker_persist_every_s: float = Field(
        default=5.0, gt=0, le=3600, description="how often changed jobs' state is saved")
    tracker_idle_evict_s: float = Field(
        default=600.0, gt=0, description="a job without telemetry this long leaves memory (saved)")
    tracker_comm_forget_s: float = Field(
        default=600.0, gt=0, description="a communicator not sampled this long stops being watched")
    tracker_state_ttl_s: float = Field(
        default=7 * 24 * 3600.0, gt=0, description="saved state of a job idle this long expires")
    tracker_state_max_bytes: int = Field(
        default=1 << 30, gt=0, description="the saved-state bucket's size bound")
    tracker_rank_takeover_s: float = Field(
        default=180.0, gt=0, description=(
            "a hello may take a rank from another agent only once that agent has not announced "
            "it for this long (agents re-announce their ranks every GREYHOUND_AGENT_HELLO_S)"))
    tracker_replay_max_messages: int = Field(
        default=20_000, ge=0, description=(
            "after a restart, at most this many of a job's telemetry messages between its saved "
            "state and the first one delivered are replayed"))
    tracker_lease_valid_s: float = Field(
        default=10.0, ge=1.0, le=60, description=(
            "a partition's owner stops consuming once its lease was not confirmed for this long; "
            "Postgres frees the lease of an owner silent for twice this"))
    tracker_lease_retry_s: float = Field(
        default=1.0, gt=0, le=60, description=(
            "how often a tracker without a partition asks for a free one (a killed owner's "
            "partition is taken over within about this)"))
