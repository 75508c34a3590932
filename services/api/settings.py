"""The REST API's knobs: where it listens, who may read it without a token, and when the fleet
view advises draining a component.

The variables keep the names they had when every process read them (``GREYHOUND_API_PORT``,
``GREYHOUND_FLEET_WINDOW_DAYS``, ...). What the notifier and the planner read as well (the
token and webhook keys, the dashboard's public address, a webhook's timeout for the API's test
delivery) stays shared (services.common.settings).
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ApiSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GREYHOUND_", extra="forbid", frozen=True)

    api_host: str = "127.0.0.1"
    api_port: int = Field(default=8000, ge=0, le=65535)
    api_tls_cert: Path | None = Field(
        default=None, description="serve HTTPS with this certificate (PEM, its chain after it)")
    api_tls_key: Path | None = Field(default=None, description="the certificate's private key")
    api_anonymous_role: Literal["viewer"] | None = Field(
        default=None, description=(
            "grant requests without a token this role (single-user local runs only); "
            "unset: every /v1 route needs a token"))
    api_metrics_public: bool = Field(
        default=False, description=(
            "True: /metrics needs no token; unset, it needs none only on a loopback address "
            "(api_host), else a viewer token like /v1"))
    api_max_body_bytes: int = Field(
        default=1 << 20, ge=1024, description="a larger request body is refused (413)")
    api_rate_per_s: float = Field(
        default=50.0, gt=0, description="requests per second one client address may send ...")
    api_rate_burst: float = Field(default=500.0, ge=1, description="... and at once (then 429)")
    api_auth_failures_per_min: float = Field(
        default=30.0, gt=0, description=(
            "failed authentications one client address may make per minute (as a burst too); "
            "past them its requests with a token are answered 429"))
    fleet_window_days: float = Field(
        default=7.0, gt=0, description="incidents this recent count towards a drain advice")
    fleet_drain_incidents: int = Field(
        default=3, ge=1, description="confirmed incidents of one GPU/node/link that advise a drain")
    fleet_drain_jobs: int = Field(
        default=2, ge=1, description="... spread over at least this many jobs")

    @model_validator(mode="before")
    @classmethod
    def _metrics_public_on_loopback(cls, data: Any) -> Any:
        """Unset, /metrics is open only where nobody else can reach it."""
        if isinstance(data, dict) and data.get("api_metrics_public") is None:
            host = str(data.get("api_host") or "127.0.0.1")
            data = {**data, "api_metrics_public": _loopback(host)}
        return data

    @model_validator(mode="after")
    def _tls_complete(self) -> ApiSettings:
        if (self.api_tls_cert is None) != (self.api_tls_key is None):
            raise ValueError("GREYHOUND_API_TLS_CERT and GREYHOUND_API_TLS_KEY go together")
        return self
