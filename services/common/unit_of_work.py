"""The unit of work: one transaction, the messages it announces, and what must follow its commit.

Every change a service makes goes through one: a consumer hands each message's handler its own
(``Work.per_message``), a route gets one from the API's dependency, and the few steps that must
be committed on their own (a validator's claim before it pauses a job, a localisation's result
minutes after its detection) open one with ``Work.unit``. The unit owns the session and the
order of what follows the handler: commit on success (a failure, or ``discard``, rolls
everything back and sends nothing), then the messages it staged in the transactional outbox are
sent (services.common.outbox), then the actions it was asked to run once committed (start a
localisation, wake a sender), and only then does the consumer ack the message. Nothing else in
the services commits, so a handler reads as: load, call the core, persist, stage.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from services.common.bus.contract import Message
from services.common.db import repository as repo

M = TypeVar("M", bound=Message)


class Outbox(Protocol):
    """What a unit needs to announce its commit: the transactional outbox
    (services.common.outbox, which runs its own steps in units without one)."""

    async def stage(self, session: AsyncSession, subject: str, msg: Message) -> str: ...

    async def flush(self, event_ids: Sequence[str]) -> int: ...

    async def send_pending(self) -> int: ...

    async def run(self, stop: asyncio.Event) -> None: ...
AfterCommit = Callable[[], Awaitable[None]]

RACE_RETRIES = 3  # a unit run again after losing a race to another unit's commit (per_message)


@dataclass
class UnitOfWork:
    """One transaction in progress (see the module docstring)."""

    session: AsyncSession
    outbox: Outbox | None = None
    staged: list[str] = field(default_factory=list)
    after: list[AfterCommit] = field(default_factory=list)
    discarded: bool = False

    async def stage(self, subject: str, msg: Message) -> str:
        """``msg`` goes out only if this unit commits, right after it does; its event id."""
        if self.outbox is None:
            raise RuntimeError("this unit of work has no outbox to announce anything through")
        event_id = await self.outbox.stage(self.session, subject, msg)
        self.staged.append(event_id)
        return event_id

    def after_commit(self, action: AfterCommit) -> None:
        """Run ``action`` once the unit committed and its messages went out (never when it rolls
        back): what must not start before the change is visible to others."""
        self.after.append(action)

    def discard(self) -> None:
        """Commit nothing of this unit and send nothing it staged (it ends without an error)."""
        self.discarded = True


class Work:
    """A service's source of units of work: its sessions and, when it announces anything, its
    outbox (whose relay the service runs as one of its tasks)."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession],
                 outbox: Outbox | None = None) -> None:
        self.sessions = sessions
        self.outbox = outbox

    @contextlib.asynccontextmanager
    async def unit(self) -> AsyncIterator[UnitOfWork]:
        """A unit that commits when the block ends without an error (see the module
        docstring); an error propagates after the rollback."""
        async with self.sessions() as session:
            uow = UnitOfWork(session, self.outbox)
            yield uow
            if uow.discarded:
                await session.rollback()
                return
            await session.commit()
        if uow.staged and self.outbox is not None:
            await self.outbox.flush(uow.staged)
        for action in uow.after:
            await action()

    async def relay(self, stop: asyncio.Event) -> None:
        """The outbox's relay (``Outbox.run``: what a flush could not send), until ``stop``."""
        if self.outbox is None:
            await stop.wait()
            return
        await self.outbox.run(stop)

    async def send_pending(self) -> None:
        """Send what the outbox holds unsent now (``Outbox.send_pending``) rather than at the
        relay's next pass."""
        if self.outbox is not None:
            await self.outbox.send_pending()

    async def writable(self) -> bool:
        """Whether the database takes writes now (a consumer's ``ready``: while it does not,
        the consumer fetches nothing and no failure counts against a message); False on a
        failure to ask that a retry could mend, a bug's exception otherwise."""
        # here, not at the top: the classification loads the bus client, which `greyhound
        # token` (a unit of work of its own) must not wait for
        from services.common.bus.errors import is_transient

        try:
            async with self.sessions() as session:
                return await repo.writable(session)
        except Exception as exc:
            if is_transient(exc):
                return False
            raise

    @contextlib.asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncSession]:
        """A session to read with: nothing written through it is ever committed."""
        async with self.sessions() as session:
            yield session

    def per_message(self, handler: Callable[[UnitOfWork, str, M], Awaitable[None]], *,
                    claim: str | None = None,
                    claims: Callable[[M], bool] = lambda _m: True,
                    race: Callable[[BaseException], bool] | None = None
                    ) -> Callable[[str, M], Awaitable[None]]:
        """A consumer's handler that gives ``handler`` one unit of work per message; the
        consumer acks after it returned, i.e. after the commit and the sends.

        With ``claim`` (the consumer's name in the processed-events ledger), each message for
        which ``claims`` holds is claimed by its event id first, and one handled before is
        skipped: a redelivery does nothing twice. With ``race``: a failure it recognises is a
        conflict with a unit another process committed meanwhile (two of them opened the same
        row; a unique index refused the second), so the unit, rolled back, runs again at once
        (up to RACE_RETRIES times) and finds the other's row, instead of failing the message."""

        async def once(subject: str, msg: M) -> None:
            async with self.unit() as uow:
                if claim is not None and claims(msg) and not await repo.claim_event(
                        uow.session, claim, msg.event_id):
                    return
                await handler(uow, subject, msg)

        async def each(subject: str, msg: M) -> None:
            for attempt in range(RACE_RETRIES + 1):
                try:
                    await once(subject, msg)
                    return
                except Exception as exc:
                    if race is None or attempt == RACE_RETRIES or not race(exc):
                        raise

        return each
