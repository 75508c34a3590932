"""Helpers for the consumer tests: bounded waiting, a JetStream connection, what a stream holds,
the DLQ's letters."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import asyncpg
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from services.common.bus.client import ensure_streams
from services.common.bus.contract import DeadLetter, IterationBatch, Subjects
from services.common.bus.streams import DEAD_LETTERS
from services.common.settings import Settings
from tests.conftest import Bus


async def until(pred: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition") -> None:
    """Wait for ``pred`` with a generous bound (the machine may be loaded); fail loudly after."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)


async def jetstream(bus: Bus, name: str) -> tuple[NATS, JetStreamContext]:
    """A connection for the consumer machinery's own tests, as ``operator``: they bind durables
    of their own, which no service's user may."""
    nc = await bus.connect(name=name)
    js = nc.jetstream()
    await ensure_streams(js, Settings())
    return nc, js


def batch(job: str, iteration: int = 1, agent: str = "a1") -> IterationBatch:
    return IterationBatch(job_id=job, agent_id=agent, rank=[0], iteration=[iteration],
                          end_ns=[0], duration_s=[0.1])


async def stored(js: JetStreamContext, stream: str, subject: str, limit: int = 32) -> list[bytes]:
    """The messages ``stream`` holds on ``subject``, oldest first (at most ``limit``)."""
    sub = await js.pull_subscribe(subject, durable=None, stream=stream,
                                  config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
    try:
        msgs = await sub.fetch(limit, timeout=1.0)
    except TimeoutError:
        msgs = []
    finally:
        await sub.unsubscribe()
    return [m.data for m in msgs]


async def letters_for(js: JetStreamContext, stream: str, subject: str) -> list[DeadLetter]:
    """Every dead letter of ``stream`` recorded for messages on ``subject``."""
    sub = await js.pull_subscribe(
        Subjects.dead_letter(stream), durable=None, stream=DEAD_LETTERS,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
    found: list[DeadLetter] = []
    try:
        while True:
            try:
                msgs = await sub.fetch(64, timeout=1.0)
            except TimeoutError:
                break
            for m in msgs:
                letter = DeadLetter.model_validate_json(m.data)
                if letter.subject == subject:
                    found.append(letter)
                await m.ack()
    finally:
        await sub.unsubscribe()
    return found


def query(url: str, sql: str) -> list[asyncpg.Record]:
    """``sql``'s rows, straight from Postgres (a SQLAlchemy asyncpg URL), outside any event loop."""
    async def run() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://", 1))
        try:
            return list(await conn.fetch(sql))
        finally:
            await conn.close()

    return asyncio.run(run())
