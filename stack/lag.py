"""How far the tracker is behind a live run's telemetry: its durable consumer's backlog.

A simulation that writes faster than the tracker reads leaves telemetry pending in JetStream:
the tracker then sees the job late, and a run that ends with a backlog would report a job that
looked healthy only because nobody had read it yet. A background thread asks NATS for the
tracker's consumer (messages not yet delivered plus delivered and not yet acknowledged) every
``every_s``; the pacer reads :attr:`TrackerLag.pending`. It connects as the tracker's own bus
user (which may read its consumer's state), with the embedded server's credentials or those in
the settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

from services.common.bus.auth import Credentials, tls_context
from services.common.bus.client import connect
from services.common.bus.streams import tracker_spec
from services.common.runtime import settings_credentials
from stack.up import Stack

log = logging.getLogger(__name__)


class TrackerLag:
    def __init__(self, stack: Stack, every_s: float = 0.5) -> None:
        assert stack.backends is not None, "start the stack first"
        self.settings = stack.settings
        self.url = stack.backends.nats_url
        nats = stack.backends.embedded_nats
        creds = settings_credentials(self.settings)
        if creds is None and nats is not None and nats.auth:
            creds = nats.credentials("tracker")
        self.credentials: Credentials | None = creds
        self.every_s = every_s
        self.pending: int | None = None  # None until the first answer
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="tracker-lag")

    def __enter__(self) -> TrackerLag:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)

    def _run(self) -> None:
        asyncio.run(self._poll())

    async def _poll(self) -> None:
        s = self.settings
        spec = tracker_spec(s)
        tls = tls_context(s.nats_tls_ca, s.nats_tls_cert, s.nats_tls_key)
        nc = await connect(self.url, name="sim-lag", credentials=self.credentials, tls=tls)
        try:
            js = nc.jetstream()
            while not self._stop.is_set():
                try:
                    info = await js.consumer_info(spec.stream, spec.durable)
                    self.pending = int(info.num_pending or 0) + int(info.num_ack_pending or 0)
                    self.error = None
                except Exception as exc:  # the tracker may not have declared it yet
                    self.error = str(exc) or type(exc).__name__
                await asyncio.sleep(self.every_s)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 2.0)
