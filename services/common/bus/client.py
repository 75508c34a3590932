"""Connecting to NATS, publishing contract messages, and the durable consumer loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.errors import BadRequestError, NotFoundError
from pydantic import BaseModel, TypeAdapter, ValidationError

from services.common.bus.contract import DeadLetter, Message, Subjects
from services.common.bus.streams import ConsumerSpec, stream_configs
from services.common.settings import Settings

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


async def connect(url: str, *, name: str) -> NATS:
    """Connect with endless reconnects: a bus restart must not kill a service or an agent."""
    return await nats.connect(
        url, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
        allow_reconnect=True, connect_timeout=5,
    )


async def ensure_streams(js: JetStreamContext, settings: Settings) -> None:
    """Create or update every stream; idempotent, so every service may call it on start."""
    for cfg in stream_configs(settings):
        try:
            await js.add_stream(cfg)
        except BadRequestError:
            await js.update_stream(cfg)


async def publish(js: JetStreamContext, subject: str, msg: Message) -> None:
    """Publish with the event id as Nats-Msg-Id so a retried publish is stored once."""
    await js.publish(subject, msg.model_dump_json().encode(), headers={"Nats-Msg-Id": msg.event_id})


@dataclass
class ConsumerStats:
    handled: int = 0
    dead_lettered: int = 0
    retried: int = 0
    reasons: dict[str, int] = field(default_factory=dict)


Handler = Callable[[str, M], Awaitable[None]]


class TransientError(Exception):
    """Raised by a handler for a failure worth retrying (database down, dependency busy)."""


class Consumer(Generic[M]):
    """A durable pull consumer that validates each message against the contract.

    A message that fails validation is terminated (never redelivered) and recorded on the
    dead-letter subject with the reason; a handler's TransientError naks it with a delay; the
    message is acked only after the handler returned, i.e. after its database commit.
    """

    def __init__(self, js: JetStreamContext, spec: ConsumerSpec, model: Any,
                 handler: Callable[[str, Any], Awaitable[None]]) -> None:
        self._js = js
        self.spec = spec
        self._adapter: TypeAdapter[Any] = TypeAdapter(model)
        self._handler = handler
        self.stats = ConsumerStats()
        self._stopping = asyncio.Event()

    async def bind(self) -> Any:
        try:
            await self._js.consumer_info(self.spec.stream, self.spec.durable)
            await self._js.add_consumer(self.spec.stream, self.spec.config())
        except NotFoundError:
            await self._js.add_consumer(self.spec.stream, self.spec.config())
        return await self._js.pull_subscribe_bind(self.spec.durable, stream=self.spec.stream)

    async def _dead_letter(self, msg: Msg, reason: str) -> None:
        key = reason.split(":", 1)[0]
        self.stats.dead_lettered += 1
        self.stats.reasons[key] = self.stats.reasons.get(key, 0) + 1
        letter = DeadLetter(stream=self.spec.stream, consumer=self.spec.durable,
                            subject=msg.subject, reason=reason[:2000],
                            payload=msg.data[:1_000_000].decode("utf-8", "replace"))
        try:
            await self._js.publish(Subjects.dead_letter(self.spec.stream),
                                   letter.model_dump_json().encode())
        except Exception:  # the DLQ being down must not stall the consumer
            log.exception("could not publish dead letter for %s", msg.subject)
        await msg.term()
        log.warning("dead-lettered %s on %s: %s", msg.subject, self.spec.durable, reason[:200])

    async def handle(self, msg: Msg) -> None:
        try:
            decoded = self._adapter.validate_json(msg.data)
        except ValidationError as exc:
            errs = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
            kind = "invalid_json" if any(e["type"] == "json_invalid" for e in exc.errors()) \
                else "schema"
            await self._dead_letter(msg, f"{kind}: {errs}")
            return
        try:
            await self._handler(msg.subject, decoded)
        except TransientError as exc:
            self.stats.retried += 1
            log.warning("transient failure on %s, retrying: %s", msg.subject, exc)
            await msg.nak(delay=self.spec.backoff_s[0])
            return
        except Exception as exc:  # a bug must not wedge the stream: record it and move on
            log.exception("handler failed on %s", msg.subject)
            await self._dead_letter(msg, f"handler_error: {type(exc).__name__}: {exc}")
            return
        self.stats.handled += 1
        await msg.ack()

    async def run(self, *, idle: Callable[[], Awaitable[None]] | None = None) -> None:
        """Fetch and handle until stop(); ``idle`` runs between fetches (periodic checks)."""
        sub = await self.bind()
        while not self._stopping.is_set():
            try:
                msgs = await sub.fetch(self.spec.batch, timeout=0.25)
            except (NatsTimeoutError, TimeoutError):
                msgs = []
            except Exception:
                if self._stopping.is_set():
                    break
                log.exception("fetch failed on %s", self.spec.durable)
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                await self.handle(msg)
            if idle is not None:
                await idle()
        with contextlib.suppress(Exception):
            await sub.unsubscribe()

    def stop(self) -> None:
        self._stopping.set()

