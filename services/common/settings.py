"""Process settings: the one place that reads the environment (prefix ``GREYHOUND_``)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Where the bus and the database live, and the knobs every service shares.

    A URL left unset means "start the embedded server in ``data_dir``", so one machine with nothing
    configured runs the whole system; production sets the URLs and nothing is started.
    """

    model_config = SettingsConfigDict(env_prefix="GREYHOUND_", extra="ignore")

    nats_url: str | None = None
    database_url: str | None = None
    data_dir: Path = Path(".greyhound")
    shm_dir: Path = Path("/dev/shm/greyhound")
    api_host: str = "127.0.0.1"
    api_port: int = Field(default=8000, ge=0, le=65535)
    telemetry_max_age_s: float = Field(default=3600.0, gt=0)
    telemetry_max_bytes: int = Field(default=2 * 1024**3, gt=0)
    events_max_age_s: float = Field(default=30 * 24 * 3600.0, gt=0)
    agent_poll_s: float = Field(default=0.05, gt=0)
    agent_counters_s: float = Field(default=0.5, gt=0)
    detector: str = "bocd-v"
    hang_floor_s: float = Field(default=60.0, gt=0, description="never call a hang sooner than this")
    hang_multiple: float = Field(default=20.0, gt=0, description="x the job's typical iteration")
    log_level: str = "INFO"
    # Validation benchmarks. Real GPUs and the simulator take the defaults (the paper's sizes);
    # the CPU fake NCCL runs a naive SGEMM, so jobs on it want a small GEMM and a loose threshold.
    validator_gemm_n: int = Field(default=2048, gt=0)
    validator_gemm_repeat: int = Field(default=3, ge=1, le=64)
    validator_p2p_bytes: list[int] = Field(default=[16 << 20, 32 << 20, 64 << 20], min_length=1)
    validator_p2p_repeat: int = Field(default=3, ge=1, le=64)
    validator_threshold: float = Field(default=0.15, gt=0)
    validator_pause_timeout_s: float = Field(default=10.0, gt=0)
    validator_bench_timeout_s: float = Field(default=30.0, gt=0)
    tracker_partitions: int = Field(
        default=1, ge=1, le=1024,
        description="jobs are hashed over this many tracker processes (1: one tracker, no hashing)")
    tracker_partition: int = Field(default=0, ge=0, description="this tracker's partition")
    # The on-call surface: REST access control, webhooks, metrics and the fleet view.
    token_key: SecretStr | None = Field(
        default=None, description=(
            "keys the hash of API tokens (a pepper kept out of the database); changing it "
            "invalidates every token"))
    webhook_key: SecretStr | None = Field(
        default=None, min_length=16, description=(
            "encrypts webhook signing secrets at rest; required once any webhook exists"))
    api_anonymous_role: Literal["viewer"] | None = Field(
        default=None, description=(
            "grant requests without a token this role (single-user local runs only); "
            "unset: every /v1 route needs a token"))
    api_metrics_public: bool = Field(
        default=True, description="False: /metrics needs a viewer token like /v1")
    api_public_url: str | None = Field(
        default=None, description="the dashboard's address as on-call reaches it (links in alerts)")
    webhook_timeout_s: float = Field(default=5.0, gt=0, le=60)
    webhook_max_attempts: int = Field(default=10, ge=1, le=50)
    webhook_backoff_base_s: float = Field(default=1.0, gt=0)
    webhook_backoff_max_s: float = Field(default=300.0, gt=0)
    notifier_poll_s: float = Field(default=0.5, gt=0)
    fleet_window_days: float = Field(
        default=7.0, gt=0, description="incidents this recent count towards a drain advice")
    fleet_drain_incidents: int = Field(
        default=3, ge=1, description="confirmed incidents of one GPU/node/link that advise a drain")
    fleet_drain_jobs: int = Field(
        default=2, ge=1, description="... spread over at least this many jobs")

    @model_validator(mode="after")
    def _partition_in_range(self) -> Settings:
        if self.tracker_partition >= self.tracker_partitions:
            raise ValueError(f"GREYHOUND_TRACKER_PARTITION must be < GREYHOUND_TRACKER_PARTITIONS "
                             f"({self.tracker_partitions}), got {self.tracker_partition}")
        return self

    @field_validator("nats_url")
    @classmethod
    def _nats_scheme(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("nats://", "tls://", "ws://", "wss://")):
            raise ValueError(f"GREYHOUND_NATS_URL must start with nats:// or tls://, got {v!r}")
        return v

    @field_validator("database_url")
    @classmethod
    def _pg_scheme(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("postgresql://", "postgresql+asyncpg://")):
            raise ValueError(f"GREYHOUND_DATABASE_URL must be a postgresql:// URL, got {v!r}")
        return v

    @field_validator("detector")
    @classmethod
    def _known_detector(cls, v: str) -> str:
        if v not in ("bocd-v", "bocd", "window"):
            raise ValueError(f"GREYHOUND_DETECTOR must be bocd-v, bocd or window, got {v!r}")
        return v


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
