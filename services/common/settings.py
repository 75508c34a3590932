"""Settings every process shares: the one place that reads the environment for them.

A service's own knobs are its own settings class, next to it (``services/<name>/settings.py``),
built by that service, with its own ``GREYHOUND_<NAME>_`` variables. All of them reject unknown
keyword arguments, so a setting that moved cannot be passed to the wrong class unnoticed.

``GREYHOUND_SECRETS_DIR`` names a folder of files, one per setting (``greyhound_nats_password``,
``greyhound_token_key``, ...), read for each setting its variable leaves unset: a container gets
its secrets as files in a volume only it mounts (deploy/compose.yaml), never in its environment,
which ``docker inspect`` and every child process can read.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SecretsSettingsSource,
    SettingsConfigDict,
)

from services.common.redact import redact
from services.common.webhooks.destination import AllowList


class Settings(BaseSettings):
    """Where the bus, the database and the rings live, and what every process needs alike.

    A URL left unset means "start the embedded server in ``data_dir``", so one machine with nothing
    configured runs the whole system; production sets the URLs and nothing is started.
    """

    # hide_input_in_errors: a validation error must not repeat a URL with its password.
    model_config = SettingsConfigDict(env_prefix="GREYHOUND_", extra="forbid",
                                      hide_input_in_errors=True)

    nats_url: str | None = Field(
        default=None, description="the bus: one URL, or a comma-separated list of a cluster's "
        "servers (nats://a:4222,nats://b:4222,...): the client connects to any and fails over")
    # Who this process is on the bus (docs/security.md): its NATS user and password, and TLS.
    # Unset with an embedded NATS: the process reads its own from the data directory.
    nats_user: str | None = None
    nats_password: SecretStr | None = None
    nats_tls_ca: Path | None = Field(default=None, description="CA bundle the server's "
                                     "certificate is checked against (else the system's)")
    nats_tls_cert: Path | None = Field(default=None, description="client certificate, when the "
                                       "server verifies clients")
    nats_tls_key: Path | None = None
    nats_no_auth: bool = Field(
        default=False, description="embedded NATS only: start it without users (a benchmark "
        "that measures the bus alone); anyone on the machine could then pause a job")
    database_url: str | None = None
    database_password: SecretStr | None = Field(
        default=None, description="the password for GREYHOUND_DATABASE_URL (replaces any the "
        "URL holds), so that the URL itself is no secret")
    database_pool_size: int = Field(
        default=4, ge=1, le=100, description="connections each process keeps open to Postgres "
        "(services x instances x (this + GREYHOUND_DATABASE_MAX_OVERFLOW) must stay under the "
        "server's max_connections; docs/scaling.md)")
    database_max_overflow: int = Field(
        default=2, ge=0, le=100, description="connections a process may open beyond the pool "
        "while busy, closed again when returned")
    data_dir: Path = Path(".greyhound")
    shm_dir: Path = Path("/dev/shm/greyhound")
    telemetry_max_age_s: float = Field(default=3600.0, gt=0)
    telemetry_max_bytes: int = Field(default=2 * 1024**3, gt=0)
    events_max_age_s: float = Field(default=30 * 24 * 3600.0, gt=0)
    log_level: str = "INFO"
    stream_replicas: int = Field(
        default=1, ge=1, le=5, description="copies of each stream on a NATS cluster (3 on a "
        "3-node cluster: any one node may be lost); 1 on a single server")
    # The telemetry stream's subjects depend on the partition count, and every process declares
    # the streams, so both stay here rather than with the tracker.
    tracker_partitions: int = Field(
        default=1, ge=1, le=1024,
        description="jobs are hashed over this many partitions of the tracker's, the analyzer's and "
        "the planner's work, each consumed by one process at a time (1: no hashing)")
    tracker_partition: int = Field(default=0, ge=0, description="this tracker's partition")
    # Read by the API and the notifier (the planner too: the dashboard address in its notes).
    token_key: SecretStr | None = Field(
        default=None, description=(
            "keys the hash of API tokens (a pepper kept out of the database); changing it "
            "invalidates every token"))
    webhook_key: SecretStr | None = Field(
        default=None, min_length=16, description=(
            "encrypts webhook signing secrets at rest; required once any webhook exists"))
    api_public_url: str | None = Field(
        default=None, description="the dashboard's address as on-call reaches it (links in alerts)")
    webhook_timeout_s: float = Field(
        default=5.0, gt=0, le=60,
        description="a webhook delivery's timeout (the notifier's, and the API's test delivery)")
    webhook_allow_hosts: str = Field(
        default="", description=(
            "comma-separated host names, addresses and CIDR blocks webhooks may reach although "
            "not public (loopback, private, link-local): an on-call receiver inside the network"))
    # The transactional outbox (services.common.outbox): every service with a database publishes
    # what its commits announce through it.
    outbox_poll_s: float = Field(
        default=2.0, gt=0, le=3600,
        description="how often a service's relay looks for messages committed and not yet sent")
    outbox_grace_s: float = Field(
        default=5.0, ge=0, le=3600,
        description="the relay leaves messages younger than this to the process that made them")

    @classmethod
    def settings_customise_sources(
            cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        folder = os.environ.get("GREYHOUND_SECRETS_DIR")
        if folder:
            file_secret_settings = SecretsSettingsSource(settings_cls, secrets_dir=folder)
        return init_settings, env_settings, dotenv_settings, file_secret_settings

    @model_validator(mode="after")
    def _password_in_url(self) -> Settings:
        if self.database_password is not None and self.database_url is not None:
            parts = urlsplit(self.database_url)
            userinfo, _, host = parts.netloc.rpartition("@")
            user = userinfo.partition(":")[0]  # as written: already quoted where it must be
            secret = quote(self.database_password.get_secret_value(), safe="")
            self.database_url = urlunsplit(parts._replace(netloc=f"{user}:{secret}@{host}"))
        return self

    @model_validator(mode="after")
    def _partition_in_range(self) -> Settings:
        if self.tracker_partition >= self.tracker_partitions:
            raise ValueError(f"GREYHOUND_TRACKER_PARTITION must be < GREYHOUND_TRACKER_PARTITIONS "
                             f"({self.tracker_partitions}), got {self.tracker_partition}")
        return self

    @model_validator(mode="after")
    def _nats_credentials_complete(self) -> Settings:
        if (self.nats_user is None) != (self.nats_password is None):
            raise ValueError("GREYHOUND_NATS_USER and GREYHOUND_NATS_PASSWORD go together")
        if (self.nats_tls_cert is None) != (self.nats_tls_key is None):
            raise ValueError("GREYHOUND_NATS_TLS_CERT and GREYHOUND_NATS_TLS_KEY go together")
        return self

    @field_validator("webhook_allow_hosts")
    @classmethod
    def _allow_hosts(cls, v: str) -> str:
        AllowList.parse(v)  # fail fast, naming the entry
        return v

    def webhook_allow(self) -> AllowList:
        return AllowList.parse(self.webhook_allow_hosts)

    @field_validator("nats_url")
    @classmethod
    def _nats_scheme(cls, v: str | None) -> str | None:
        if v is None:
            return v
        servers = nats_servers(v)
        if not servers:
            raise ValueError("GREYHOUND_NATS_URL names no server")
        for url in servers:
            if not url.startswith(("nats://", "tls://", "ws://", "wss://")):
                raise ValueError(f"each URL of GREYHOUND_NATS_URL must start with nats:// or "
                                 f"tls://, got {redact(url)!r}")
        return v

    @field_validator("database_url")
    @classmethod
    def _pg_scheme(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("postgresql://", "postgresql+asyncpg://")):
            raise ValueError(f"GREYHOUND_DATABASE_URL must be a postgresql:// URL, got "
                             f"{redact(v)!r}")
        return v


def nats_servers(url: str) -> list[str]:
    """The servers of a GREYHOUND_NATS_URL: one URL, or several separated by commas."""
    return [u.strip() for u in url.split(",") if u.strip()]


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
