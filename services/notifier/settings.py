"""The notifier's knobs: how often it looks for due deliveries and how a failed one is retried.

The variables keep the names they had when every process read them
(``GREYHOUND_WEBHOOK_MAX_ATTEMPTS``, ``GREYHOUND_NOTIFIER_POLL_S``, ...). A delivery's timeout
stays shared (services.common.settings): the API's test delivery obeys it too.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class NotifierSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GREYHOUND_", extra="forbid", frozen=True)

    webhook_max_attempts: int = Field(default=10, ge=1, le=50)
    webhook_backoff_base_s: float = Field(default=1.0, gt=0)
    webhook_backoff_max_s: float = Field(default=300.0, gt=0)
    notifier_poll_s: float = Field(default=0.5, gt=0)
