"""A job's recent telemetry, read back from the JetStream telemetry stream on request.

The database holds incidents, not iteration times: those stay on the bus (kept for
``telemetry_max_age_s``). The API reads one job's window with a short-lived ordered consumer
(memory storage, no acks, removed afterwards) and stops at ``max_messages``, so a dashboard
refresh costs a bounded read whatever the job's size; the answer says when it was cut.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TypeVar

from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from pydantic import BaseModel

from services.common.bus.contract import CollectiveBatch, IterationBatch, Subjects
from services.common.bus.reader import TelemetryReader, decode

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


@dataclass
class Window:
    """Rows of one job since ``since`` (columns as in the contract's batches)."""

    since: datetime
    messages: int = 0
    truncated: bool = False
    iterations: list[IterationBatch] = field(default_factory=list)
    collectives: list[CollectiveBatch] = field(default_factory=list)


async def _read(js: JetStreamContext, subject: str, since: datetime, model: type[M], *,
                max_messages: int, fetch_timeout_s: float) -> tuple[list[M], bool]:
    reader = await TelemetryReader.open(js, "api-read", subject, start_time=since)
    sub = reader.sub
    out: list[M] = []
    truncated = False
    try:
        info = await sub.consumer_info()
        pending = int(info.num_pending or 0)
        while pending > 0:
            if len(out) >= max_messages:
                truncated = True
                break
            try:
                msgs = await sub.fetch(min(256, max_messages - len(out)), timeout=fetch_timeout_s)
            except (NatsTimeoutError, TimeoutError):
                break
            for msg in msgs:
                pending = int(msg.metadata.num_pending or 0)
                item = decode(msg, model)
                if item is not None:
                    out.append(item)
    finally:
        await reader.close()
    return out, truncated


async def read_window(js: JetStreamContext, job_id: str, *, window_s: float,
                      max_messages: int = 4000, fetch_timeout_s: float = 1.0,
                      collectives: bool = True, now: Callable[[], datetime] | None = None) -> Window:
    since = (now or (lambda: datetime.now(UTC)))() - timedelta(seconds=window_s)
    w = Window(since=since)
    w.iterations, cut = await _read(js, Subjects.job_iterations(job_id), since, IterationBatch,
                                    max_messages=max_messages, fetch_timeout_s=fetch_timeout_s)
    w.truncated |= cut
    if collectives:
        w.collectives, cut = await _read(js, Subjects.job_collectives(job_id), since,
                                         CollectiveBatch, max_messages=max_messages // 4,
                                         fetch_timeout_s=fetch_timeout_s)
        w.truncated |= cut
    w.messages = len(w.iterations) + len(w.collectives)
    return w
