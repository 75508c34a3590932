"""Settings every process shares: the one place that reads the environment for them.

A service's own knobs are its own settings class, next to it (``services/<name>/settings.py``),
built by that service, with its own ``GREYHOUND_<NAME>_`` variables. All of them reject unknown
keyword arguments, so a setting that moved cannot be passed to the wrong class unnoticed.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Where the bus, the database and the rings live, and what every process needs alike.

    A URL left unset means "start the embedded server in ``data_dir``", so one machine with nothing
    configured runs the whole system; production sets the URLs and nothing is started.
    """

    model_config = SettingsConfigDict(env_prefix="GREYHOUND_", extra="forbid")

    nats_url: str | None = None
    database_url: str | None = None
    data_dir: Path = Path(".greyhound")
    shm_dir: Path = Path("/dev/shm/greyhound")
    api_host: str = "127.0.0.1"
    api_port: int = Field(default=8000, ge=0, le=65535)
    telemetry_max_age_s: float = Field(default=3600.0, gt=0)
    telemetry_max_bytes: int = Field(default=2 * 1024**3, gt=0)
    events_max_age_s: float = Field(default=30 * 24 * 3600.0, gt=0)
    log_level: str = "INFO"
    # The telemetry stream's subjects depend on the partition count, and every process declares
    # the streams, so both stay here rather than with the tracker.
    tracker_partitions: int = Field(
        default=1, ge=1, le=1024,
        description="jobs are hashed over this many tracker processes (1: one tracker, no hashing)")
    tracker_partition: int = Field(default=0, ge=0, description="this tracker's partition")

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


def as_env(settings: BaseSettings) -> dict[str, str]:
    """The environment that rebuilds ``settings`` in a child process: lists and dicts as JSON,
    secrets as their values (their str() is asterisks), unset values left out."""
    prefix = settings.model_config.get("env_prefix", "")
    out = {}
    for name, value in settings.model_dump().items():
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        if value is None:
            continue
        text = json.dumps(value) if isinstance(value, list | dict) else str(value)
        out[f"{prefix}{name}".upper()] = text
    return out


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
