"""Response models of the REST API (built from ORM rows, never hand-built dicts)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict


class TimelineEntry(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    stage: str
    at: datetime
    detail: dict[str, Any]


class IncidentOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    job_id: str
    kind: str
    status: str
    severity: float
    summary: str
    culprit: dict[str, Any]
    evidence: dict[str, Any]
    opened_at: datetime
    updated_at: datetime
    resolved_at: datetime | None
    timeline: list[TimelineEntry]


class RankOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    rank: int
    host: str
    node: int | None
    device: int
    pid: int
    agent_id: str
    last_seen_at: datetime


class JobOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    world_size: int | None
    topology: dict[str, Any]
    first_seen_at: datetime
    last_seen_at: datetime


class JobDetailOut(JobOut):
    ranks: list[RankOut]


class ErrorOut(BaseModel):
    detail: str


class Health(BaseModel):
    status: str
    database: bool
