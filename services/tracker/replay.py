"""Observing every telemetry message once across tracker restarts, by stream sequence.

The tracker acks a message once it is observed and saves each job's state every few seconds, so
a crash (not a shutdown) forgets what was observed since the last save although those messages
were acked: they will not come again on the durable consumer. Losing them is not harmless: a
restart a few iterations after a fault began gives a detector that never saw the healthy level,
and the slowdown is never reported. So a saved state records the stream sequence of the newest
message it holds (per job: one job's telemetry goes to one tracker), and when the job is loaded
the tracker reads that job's messages between the saved sequence and the first one delivered to
it straight from the stream (``replay``); every message at or below the saved sequence that the
durable delivers again (an ack lost in the crash) is skipped. Each message is therefore observed
once, whatever was acked.

The durable consumer hands the handler decoded messages only; ``SequencedConsumer`` puts each
message's stream sequence in a context variable for the handler to read.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextvars import ContextVar
from typing import Any

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext

from services.common.bus.client import Consumer, stream_seq
from services.common.bus.contract import IterationBatch, Subjects
from services.common.bus.reader import TelemetryReader, decode

log = logging.getLogger(__name__)

STREAM_SEQ: ContextVar[int | None] = ContextVar("greyhound_stream_seq", default=None)


class SequencedConsumer(Consumer[Any]):
    """A durable consumer whose handler can read each message's stream sequence
    (``STREAM_SEQ.get()``) while it runs."""

    async def handle(self, msg: Msg) -> None:
        token = STREAM_SEQ.set(stream_seq(msg))
        try:
            await super().handle(msg)
        finally:
            STREAM_SEQ.reset(token)


async def replay(js: JetStreamContext, job: str, *, after: int, before: int, limit: int,
                 fetch_timeout_s: float = 2.0) -> AsyncIterator[tuple[int, IterationBatch]]:
    """The job's iteration batches with ``after < sequence < before``, in stream order; only the
    first ``limit`` of them (a gap longer than that costs the detector some history, not the
    process its memory or its start-up). Messages that fail the contract are passed over (the
    durable consumer dead-lettered them)."""
    if before <= after + 1 or limit <= 0:
        return
    reader = await TelemetryReader.open(js, "tracker-replay", Subjects.job_iterations(job),
                                        start_seq=after + 1)
    sub = reader.sub
    given = 0
    try:
        pending = int((await sub.consumer_info()).num_pending or 0)
        while pending > 0 and given < limit:
            try:
                msgs = await sub.fetch(min(256, pending, limit - given), timeout=fetch_timeout_s)
            except (TimeoutError, NatsTimeoutError):
                return
            for m in msgs:
                seq = stream_seq(m)
                pending = int(m.metadata.num_pending)
                if seq is None or seq >= before:
                    return
                batch = decode(m, IterationBatch)
                if batch is None:
                    continue
                given += 1
                yield seq, batch
        if pending > 0:
            log.warning("job %s: replayed %d telemetry messages, the limit; older ones between "
                        "its saved state and now were skipped", job, given)
    finally:
        await reader.close()
