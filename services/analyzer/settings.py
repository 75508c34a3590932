"""The analyzer's knobs: how its work is split by job over several processes
(services.common.ownership), how long finished records are kept (the analyzer runs the
retention pass, see services.analyzer.retention), ``GREYHOUND_ANALYZER_<FIELD>``."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.common.ownership import GivenPartition, LeaseRetryS, LeaseValidS


class AnalyzerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GREYHOUND_ANALYZER_", extra="forbid",
                                      frozen=True)

    # the partition count is GREYHOUND_TRACKER_PARTITIONS, shared: services.common.ownership
    partition: GivenPartition = None
    lease_valid_s: LeaseValidS = 10.0
    lease_retry_s: LeaseRetryS = 1.0
    resume_every_s: float = Field(
        default=30.0, gt=0, description=(
            "how often open incidents whose localisation never recorded a result are localised "
            "again (also at start-up)"))
    retention_every_s: float = Field(default=3600.0, gt=0, description="how often old rows go")
    retention_batch: int = Field(default=1000, ge=1, le=100_000,
                                 description="rows per delete statement (short locks)")
    keep_resolved_days: float = Field(
        default=90.0, gt=0, description="resolved incidents (timeline, plans, claims with them)")
    keep_processed_days: float = Field(
        default=35.0, gt=0, description=(
            "processed-event claims; never less than the events stream keeps messages "
            "(GREYHOUND_EVENTS_MAX_AGE_S), or a replayed event would be handled twice"))
    keep_webhook_days: float = Field(
        default=30.0, gt=0, description="webhook attempts, and deliveries delivered or failed")
    keep_audit_days: float = Field(default=365.0, gt=0, description="audit log entries")
    keep_outbox_days: float = Field(default=7.0, gt=0, description="outbox messages sent")
    keep_idle_jobs_days: float = Field(
        default=90.0, gt=0, description="jobs not seen this long, once no incident is left")
