"""The transactional outbox: a message that announces a commit is part of that commit.

Publishing after a commit has a gap: a crash, a failed publish or a bus restart between the two
loses the message for good, since a redelivered input finds its work done (the event is claimed)
and does not announce it again. So a handler *stages* each message in its own transaction
(``Outbox.stage``: a row in the ``outbox`` table), commits, and then asks for it to be sent
(``Outbox.flush``). A relay (``Outbox.run``, one task of every service that has a database)
sends whatever is left at start-up and every ``outbox_poll_s``: messages whose process died
before sending them, or whose publish failed. Every send uses the message's event id as
Nats-Msg-Id, so a message sent twice (published, then the process died before marking it sent)
is stored once by JetStream within its duplicate window, and consumers claim event ids besides.

Messages go out in commit order (the table's sequence); a transient failure stops a pass so a
later message never overtakes an earlier one. A message the server refuses for good (over its
size limit, a bad subject) is marked failed and kept for reading, not retried forever.

Several processes of one service each run a relay, and each locks the rows it sends (SKIP
LOCKED), so across processes commit order alone does not hold. Where that matters, a stream
keeping one message per subject (the plans: each job's newest version), the kinds named
``latest_only`` are sent one relay at a time per subject (a transaction advisory lock on the
subject, taken without waiting: a relay that finds it taken stops its pass and comes back), and
a row is not sent once a later row of its subject has been (it is marked sent, superseded): the
stream only ever moves to a later message of the subject. Later means a higher sequence, which
is the producer's order for a subject whose rows are made under one lock (a job's plan versions:
services.common.db.exclusion.next_plan_version).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from services.common.bus.contract import Message
from services.common.bus.errors import classify, describe
from services.common.db import repository as repo
from services.common.unit_of_work import Work

log = logging.getLogger(__name__)


@dataclass
class OutboxStats:
    sent: int = 0
    duplicates: int = 0  # the server already had it (sent before, not marked)
    failed_sends: int = 0  # publishes that raised (retried by the relay unless final)
    refused: int = 0  # publishes no retry can fix: marked failed
    superseded: int = 0  # latest-only rows not sent: a later one of their subject went first
    flush_failures: int = 0  # a post-commit flush that could not run (the database away)
    relay_failures: int = 0


async def send(js: JetStreamContext, subject: str, payload: bytes, event_id: str) -> bool:
    """One publish, de-duplicated by event id; True when the server already had the message."""
    ack = await js.publish(subject, payload, headers={"Nats-Msg-Id": event_id})
    return bool(ack.duplicate)


class Outbox:
    """A service's outbox: stage in a transaction, flush after its commit, relay the rest.

    ``ordered``: a flush sends every unsent message of this producer, oldest first, not only
    the ones just committed. A stream that keeps each subject's last message (the planner's
    plans) needs it: a version whose first send failed must not be overtaken by the next one,
    which a send of only the newest ids would do while the relay waits out its grace period.
    ``latest_only``: the message kinds whose stream keeps one message per subject, never sent
    after a later one of their subject (see the module docstring). Without a bus (``js`` None:
    an API process serving the database alone) nothing is sent: the messages wait in the table
    for a relay that has one."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession], js: JetStreamContext | None,
                 *, producer: str, poll_s: float = 2.0, grace_s: float = 5.0,
                 batch: int = 256, ordered: bool = False,
                 latest_only: frozenset[str] = frozenset()) -> None:
        self._work = Work(sessions)
        self._js = js
        self.producer = producer
        self.poll_s = poll_s
        self.grace_s = grace_s
        self.batch = batch
        self.ordered = ordered
        self.latest_only = latest_only
        self.stats = OutboxStats()
        self._lock = asyncio.Lock()  # one send pass at a time in this process keeps the order

    async def stage(self, session: AsyncSession, subject: str, msg: Message) -> str:
        """Queue ``msg`` in the caller's transaction (sent once the caller committed and called
        flush); staging the same event id twice is a no-op. Returns the event id."""
        await repo.stage_message(session, event_id=msg.event_id, subject=subject,
                                 kind=type(msg).__name__, payload=msg.model_dump_json(),
                                 producer=self.producer,
                                 incident_id=getattr(msg, "incident_id", None))
        return msg.event_id

    async def flush(self, event_ids: Sequence[str]) -> int:
        """Send these committed messages now (an ordered outbox: every unsent one of its
        producer); how many went out. Never raises: what could not be sent stays in the table
        for the relay."""
        if not event_ids:
            return 0
        return await self._send_now(None if self.ordered else event_ids)

    async def send_pending(self) -> int:
        """Send this producer's unsent messages now, oldest first (one batch), whoever
        committed them; how many went out. Never raises, like ``flush``."""
        return await self._send_now(None)

    async def _send_now(self, event_ids: Sequence[str] | None) -> int:
        if self._js is None:
            return 0
        try:
            return await self._pass(event_ids=event_ids)
        except Exception as exc:
            self.stats.flush_failures += 1
            log.warning("%s: sending committed message(s) failed; the relay retries: %s",
                        self.producer, describe(exc))
            return 0

    async def relay_once(self) -> int:
        """Send everything unsent that is older than the grace period (the process that made a
        younger one is expected to send it itself); how many went out."""
        total = 0
        if self._js is None:
            return 0
        while True:
            before = datetime.now(UTC) - timedelta(seconds=self.grace_s)
            sent, more = await self._pass_counted(created_before=before)
            total += sent
            if not more:
                return total

    async def run(self, stop: asyncio.Event) -> None:
        """The relay: at start-up, then every ``poll_s`` until ``stop``. A database or bus that is
        away is waited out; any other failure (a bug) ends the task, hence the service."""
        streak = 0
        while not stop.is_set():
            try:
                sent = await self.relay_once()
            except Exception as exc:
                if classify(exc) == "permanent":
                    raise
                self.stats.relay_failures += 1
                streak += 1
                if streak == 1 or streak % 60 == 0:
                    log.warning("%s outbox relay failed (%d in a row): %s", self.producer, streak,
                                describe(exc))
            else:
                if streak:
                    log.info("%s outbox relay works again after %d failures", self.producer,
                             streak)
                    streak = 0
                if sent:
                    log.info("%s outbox relay sent %d message(s) left unsent", self.producer, sent)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.poll_s)

    async def _pass(self, *, event_ids: Sequence[str] | None = None,
                    created_before: datetime | None = None) -> int:
        sent, _ = await self._pass_counted(event_ids=event_ids, created_before=created_before)
        return sent

    async def _pass_counted(self, *, event_ids: Sequence[str] | None = None,
                            created_before: datetime | None = None) -> tuple[int, bool]:
        """One locked batch: (sent, whether a full batch went out and more may wait)."""
        assert self._js is not None
        async with self._lock, self._work.unit() as uow:
            session = uow.session
            rows = await repo.claim_unsent(session, limit=self.batch, event_ids=event_ids,
                                           created_before=created_before, producer=self.producer)
            done: list[int] = []
            stopped = False
            for row in rows:
                if row.kind in self.latest_only:
                    if not await repo.try_lock_name(session, row.subject):
                        stopped = True  # another relay sends this subject now: come back
                        break
                    if await repo.sent_later(session, row.subject, row.seq):
                        done.append(row.seq)
                        self.stats.superseded += 1
                        continue
                try:
                    dup = await send(self._js, row.subject, row.payload.encode(), row.event_id)
                except Exception as exc:
                    final = classify(exc) == "permanent"
                    self.stats.failed_sends += 1
                    await repo.mark_unsent(session, row.seq, describe(exc), final=final,
                                           at=datetime.now(UTC))
                    if final:
                        self.stats.refused += 1
                        log.error("%s: the bus refused %s %s for good (kept in the outbox as "
                                  "failed): %s", self.producer, row.kind, row.event_id,
                                  describe(exc))
                        continue
                    log.warning("%s: publishing %s %s failed; retried later: %s",
                                self.producer, row.kind, row.event_id, describe(exc))
                    stopped = True
                    break
                done.append(row.seq)
                self.stats.sent += 1
                self.stats.duplicates += dup
            await repo.mark_sent(session, done, datetime.now(UTC))
        return len(done), not stopped and len(rows) == self.batch and event_ids is None
