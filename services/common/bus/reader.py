"""A short-lived reader of the telemetry stream: what the API's charts, the tracker's replay
after a restart and the planner's iteration watch read with, instead of a durable consumer.

The consumer is the reader's own (a fresh name under the caller's prefix, which the bus
permissions allow for services that ``read`` the stream), acknowledges nothing, lives in memory
and is deleted on close; one that is never closed (the process died) is removed by the server
after ``idle_s`` without a fetch.
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from pydantic import BaseModel, ValidationError

from services.common.bus.contract import subject_mismatch
from services.common.bus.streams import TELEMETRY

M = TypeVar("M", bound=BaseModel)


def decode(msg: Msg, model: type[M]) -> M | None:
    """The message as ``model``, or None when it fails the contract or says another job or
    agent than its subject: the durable consumers dead-letter those, a reader passes them
    over (what a forged body claims must not reach a chart, a plan or a detector's replay)."""
    try:
        out = model.model_validate_json(msg.data)
    except ValidationError:
        return None
    return None if subject_mismatch(msg.subject, out) is not None else out


@dataclass
class TelemetryReader:
    js: JetStreamContext
    name: str
    sub: JetStreamContext.PullSubscription

    @classmethod
    async def open(cls, js: JetStreamContext, prefix: str, subject: str, *,
                   start_time: datetime | None = None, start_seq: int | None = None,
                   idle_s: float = 30.0) -> TelemetryReader:
        """From ``start_time`` or from stream sequence ``start_seq`` (exactly one of them)."""
        if (start_time is None) == (start_seq is None):
            raise ValueError("a telemetry reader starts at a time or at a sequence, one of them")
        name = f"{prefix}-{uuid.uuid4().hex[:16]}"
        if start_time is not None:
            config = ConsumerConfig(name=name, deliver_policy=DeliverPolicy.BY_START_TIME,
                                    opt_start_time=start_time.astimezone(UTC))
        else:
            config = ConsumerConfig(name=name, deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                                    opt_start_seq=start_seq)
        config.ack_policy, config.inactive_threshold = AckPolicy.NONE, idle_s
        config.mem_storage, config.filter_subject = True, subject
        await js.add_consumer(TELEMETRY, config)
        try:
            return cls(js, name, await js.pull_subscribe_bind(name, stream=TELEMETRY))
        except BaseException:
            with contextlib.suppress(Exception):
                await js.delete_consumer(TELEMETRY, name)
            raise

    async def close(self) -> None:
        """Best effort: a bus that is away leaves the consumer to expire by itself."""
        with contextlib.suppress(Exception):
            await self.sub.unsubscribe()
        with contextlib.suppress(Exception):
            await self.js.delete_consumer(TELEMETRY, self.name)
