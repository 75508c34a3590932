"""Waiting out a database that is away (a transient failure: services.common.bus.errors).

For a result that exists only in memory (``patiently``): a localisation's profile and a
validation's measurements cannot be taken again without profiling or pausing the job again, so
the unit that records them is tried again for as long as the service's patience; giving up loses
the result, waiting keeps it. For a periodic step (``periodically``: taking up what a dead
process left), the next round tries again. Kept apart from the unit of work, which the token
command uses too: that one must not load the bus client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from services.common.bus.errors import describe, is_transient
from services.common.unit_of_work import UnitOfWork, Work

log = logging.getLogger(__name__)

T = TypeVar("T")


async def patiently(work: Work, step: Callable[[UnitOfWork], Awaitable[T]], *,
                    patience_s: float, what: str) -> T:
    """``step`` in a unit of its own, tried again (in a new unit) while the failure is
    transient, for up to ``patience_s``; any other failure, or the last one, propagates."""
    deadline = time.monotonic() + patience_s
    delay = 0.5
    while True:
        try:
            async with work.unit() as uow:
                return await step(uow)
        except Exception as exc:
            if not is_transient(exc) or time.monotonic() + delay > deadline:
                raise
            log.warning("%s failed, retrying in %.1fs: %s", what, delay, describe(exc))
            await asyncio.sleep(delay)
            delay = min(2 * delay, 10.0)


async def periodically(step: Callable[[], Awaitable[object]], every_s: float,
                       stop: asyncio.Event, *, what: str) -> None:
    """``step`` at start-up and every ``every_s`` until ``stop``; a transient failure is logged
    and the next round tries again, any other ends the task (the service's, for its supervisor
    to restart)."""
    while not stop.is_set():
        try:
            await step()
        except Exception as exc:
            if not is_transient(exc):
                raise
            log.warning("%s failed: %s", what, describe(exc))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
