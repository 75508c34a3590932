"""Reading the dead-letter stream and sending its letters back where they came from.

A letter is the failed message's payload with why it failed (bus.dead_letters). What a fix
makes good again (a bug mended, a setting corrected, a dependency restored long after a
message's tries ran out) is replayed: the payload is published again on the subject it was
published on, and the letter leaves the stream. A replayed message is a new one on the stream
(its Nats-Msg-Id is the letter's, so replaying the same letter twice stores it once), and the
consumers' processed-events ledger skips an event id handled before: nothing is done twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from pydantic import ValidationError

from services.common.bus.client import stream_seq
from services.common.bus.contract import DeadLetter, Subjects
from services.common.bus.streams import DEAD_LETTERS

FETCH_TIMEOUT_S = 1.0


@dataclass(frozen=True, slots=True)
class Letter:
    seq: int  # its sequence in the dead-letter stream
    letter: DeadLetter

    @property
    def replayable(self) -> bool:
        """Only a whole payload can be sent again (one cut to fit the letter cannot)."""
        return self.letter.payload_cut_bytes == 0 and "\ufffd" not in self.letter.payload


@dataclass(frozen=True, slots=True)
class Selection:
    """Which letters: all by default; else those of one stream, one consumer, whose reason
    starts with ``reason``, or with one of ``seqs``."""

    stream: str | None = None
    consumer: str | None = None
    reason: str | None = None
    seqs: frozenset[int] = frozenset()

    def takes(self, item: Letter) -> bool:
        x = item.letter
        return ((self.stream is None or x.stream == self.stream)
                and (self.consumer is None or x.consumer == self.consumer)
                and (self.reason is None or x.reason.startswith(self.reason))
                and (not self.seqs or item.seq in self.seqs))


async def letters(js: JetStreamContext, selection: Selection = Selection()
                  ) -> AsyncIterator[Letter]:
    """Every letter the stream holds that ``selection`` takes, oldest first."""
    subject = (Subjects.dead_letter(selection.stream) if selection.stream
               else Subjects.ALL_DEAD_LETTERS)
    sub = await js.pull_subscribe(subject, durable=None, stream=DEAD_LETTERS, config=ConsumerConfig(
        deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE, mem_storage=True,
        inactive_threshold=30.0))
    try:
        while True:
            try:
                msgs = await sub.fetch(256, timeout=FETCH_TIMEOUT_S)
            except TimeoutError:
                return
            for m in msgs:
                seq = stream_seq(m)
                try:
                    item = Letter(seq or 0, DeadLetter.model_validate_json(m.data))
                except ValidationError:
                    continue  # not a letter this code wrote
                if selection.takes(item):
                    yield item
            if int(msgs[-1].metadata.num_pending or 0) == 0:
                return
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def replay(js: JetStreamContext, item: Letter) -> None:
    """Publish the letter's payload on the subject it was published on, then drop the letter.
    Raises ValueError for a letter whose payload was cut; a publish the server refuses
    raises (and keeps the letter)."""
    if not item.replayable:
        raise ValueError(f"dead letter {item.seq}: its payload was cut to fit, it cannot be sent "
                         "again")
    x = item.letter
    await js.publish(Subjects.published(x.subject), x.payload.encode(),
                     headers={"Nats-Msg-Id": f"replay.{x.stream}.{item.seq}"})
    with contextlib.suppress(NotFoundError):
        await js.delete_msg(DEAD_LETTERS, item.seq)
