"""What an operator may choose for ``greyhound deploy init`` in deploy/.env (compose hands each
to the init container as ``GREYHOUND_DEPLOY_<NAME>``; docs/security.md lists them). Anything
left unset is generated once and kept."""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


class DeploySettings(BaseSettings):
    # env_ignore_empty: compose passes ``${VAR:-}``, an empty string for what .env leaves out.
    model_config = SettingsConfigDict(env_prefix="GREYHOUND_DEPLOY_", extra="forbid",
                                      frozen=True, env_ignore_empty=True)

    nats_hosts: str = Field(
        default="", description="comma-separated names and addresses training nodes reach NATS "
        "by (its certificate names them; the first goes into a node's bundle)")
    nats_port: int = Field(default=4222, ge=1, le=65535,
                           description="the port NATS is published on (a node's bundle)")
    api_hosts: str = Field(default="", description="names and addresses of the API's HTTPS "
                           "certificate, besides api and localhost")
    postgres_password: SecretStr | None = Field(default=None, min_length=12)
    token_key: SecretStr | None = Field(default=None, min_length=16)
    webhook_key: SecretStr | None = Field(default=None, min_length=16)

    def nats_names(self) -> list[str]:
        return _names(self.nats_hosts)

    def api_names(self) -> list[str]:
        return _names(self.api_hosts)
