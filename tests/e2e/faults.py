"""Faults the resilience tests inject into a running stack: kill -9 of a service and its restart
(as its supervisor would, with the service's own bus user), and Postgres taken away behind a
loopback proxy. (The embedded NATS restarts on its port and store: EmbeddedNats.start(port=).)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Coroutine
from typing import Any

from stack.up import Stack
from tests.services.common.pg_proxy import PgProxy


def kill9(stack: Stack, name: str) -> None:
    """SIGKILL to the service's process group: no shutdown code runs, as in a crash."""
    proc = stack.procs[name]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def restart(stack: Stack, name: str) -> None:
    """Start the service again the way the stack started it (its supervisor's job)."""
    stack.spawn(name)


class ThreadedPgProxy:
    """tests.services.common.pg_proxy.PgProxy on its own event loop thread, for sync tests."""

    def __init__(self, db_url: str) -> None:
        self._proxy = PgProxy(db_url)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="pg-proxy")
        self._thread.start()

    @property
    def url(self) -> str:
        return self._proxy.url

    def _call(self, coro: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    def start(self) -> None:
        self._call(self._proxy.start())

    def stop(self) -> None:
        self._call(self._proxy.stop())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
