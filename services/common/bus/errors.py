"""Which failures are worth retrying: one classification for every consumer and the API.

A message whose handler failed for a reason outside the message (the database restarting, a
connection cut mid-transaction, the bus reconnecting) must be retried, not dead-lettered; a message
that can never succeed (bad data, a conflict, a bug) must go to the dead-letter queue at once
instead of holding its place through every redelivery.

When in doubt about an infrastructure error the rule leans to "transient": a transient verdict on
a hopeless message costs a few redeliveries before it is dead-lettered anyway (deliveries run out),
while a permanent verdict on a good message loses it to the dead-letter queue during an outage.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Literal

import asyncpg.exceptions as pg
import nats.errors as nats_errors
import nats.js.errors as js_errors
import sqlalchemy.exc as sa

Kind = Literal["transient", "permanent"]


class TransientError(Exception):
    """Raised by a handler for a failure worth retrying (database down, dependency busy)."""


class PermanentError(Exception):
    """Raised by a handler for a failure that no retry can fix, whatever caused it."""


# SQLSTATE classes (and single codes) where the same statement can succeed later: connection
# exceptions, invalid transaction state (25006, a read-only server: the standby a failover
# left this connection on, writable again once the pool reaches the new primary), transaction
# rollbacks (serialization failure, deadlock), insufficient resources (too many connections,
# disk full), operator intervention (admin or crash shutdown, cannot connect now, query
# cancelled), system errors, and a lock that was not available.
_TRANSIENT_SQLSTATE_PREFIXES = ("08", "25", "40", "53", "57", "58", "55P03")

# Python's own names for a connection that failed or was cut; the asyncpg and SQLAlchemy
# connection errors below complete the list.
_TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    OSError,  # includes ConnectionError, TimeoutError (= asyncio.TimeoutError), socket errors
    sa.OperationalError,
    sa.InterfaceError,
    sa.DisconnectionError,
    sa.TimeoutError,  # no pooled connection became free in time
    pg.PostgresConnectionError,
    pg.InterfaceError,  # asyncpg's client side: "connection is closed" and friends
    nats_errors.TimeoutError,
    nats_errors.NoServersError,
    nats_errors.ConnectionClosedError,
    nats_errors.StaleConnectionError,
    nats_errors.ConnectionReconnectingError,
    nats_errors.ConnectionDrainingError,
    nats_errors.OutboundBufferLimitError,
    nats_errors.NoRespondersError,  # JetStream not (yet) answering on this account
    nats_errors.SlowConsumerError,
    js_errors.ServiceUnavailableError,
    js_errors.NoStreamResponseError,
    js_errors.TooManyStalledMsgsError,
)

# Checked before the transient types: subclasses of those that no retry can fix.
_PERMANENT_TYPES: tuple[type[BaseException], ...] = (
    sa.IntegrityError,
    pg.ClientConfigurationError,  # an asyncpg InterfaceError, but a wrong setting
    nats_errors.MaxPayloadError,
    nats_errors.BadSubjectError,
)

_MAX_LINKS = 64


def _links(exc: BaseException) -> Iterator[BaseException]:
    """The exception, then what caused it (``__cause__``, the DBAPI ``orig``, the context it was
    raised in unless hidden with ``from None``) and the members of exception groups, each once."""
    seen: set[int] = set()
    todo = [exc]
    while todo and len(seen) < _MAX_LINKS:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        orig = getattr(e, "orig", None)
        if isinstance(orig, BaseException):
            todo.append(orig)
        if e.__cause__ is not None:
            todo.append(e.__cause__)
        elif e.__context__ is not None and not e.__suppress_context__:
            todo.append(e.__context__)


def _transient_link(e: BaseException) -> bool:
    if isinstance(e, _PERMANENT_TYPES):
        return False
    if isinstance(e, sa.DBAPIError) and e.connection_invalidated:
        return True
    if isinstance(e, js_errors.APIError) and e.code == 503:
        return True
    sqlstate = getattr(e, "sqlstate", None)
    if isinstance(sqlstate, str) and sqlstate.startswith(_TRANSIENT_SQLSTATE_PREFIXES):
        return True
    return isinstance(e, _TRANSIENT_TYPES)


def classify(exc: BaseException) -> Kind:
    """``transient`` when a retry may succeed, ``permanent`` when it cannot.

    The outermost explicit TransientError or PermanentError in the chain decides (the handler
    knows best); otherwise the failure is transient when any link of its chain is (a ValueError
    raised while a dropped connection was being handled still came from the dropped connection),
    and permanent otherwise (validation errors, conflicts, bugs).
    """
    links = list(_links(exc))
    for e in links:
        if isinstance(e, TransientError):
            return "transient"
        if isinstance(e, PermanentError):
            return "permanent"
    return "transient" if any(_transient_link(e) for e in links) else "permanent"


def is_transient(exc: BaseException) -> bool:
    return classify(exc) == "transient"


def describe(exc: BaseException) -> str:
    """One line naming the exception and its causes, e.g. for a dead letter's reason."""
    parts = []
    for e in _links(exc):
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        parts.append(f"{type(e).__name__}: {text}" if text else type(e).__name__)
    return " <- ".join(parts)


async def available(probe: Callable[[], Awaitable[object]], *, timeout_s: float = 2.0) -> bool:
    """Run a readiness probe (e.g. a database ping): False when what it talks to is away.

    A transient failure or no answer within ``timeout_s`` means "unavailable", which a health
    endpoint reports as such instead of a 500; a permanent failure is a bug and propagates.
    """
    try:
        await asyncio.wait_for(probe(), timeout_s)
    except Exception as exc:
        if is_transient(exc):
            return False
        raise
    return True
