"""Faults the resilience tests inject into a running stack: kill -9 of a service and its restart
(as its supervisor would), a nats-server stopped and started again on the same port and store,
and Postgres taken away behind a loopback proxy."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from services.common.embedded import nats_server_binary
from services.registry import BY_NAME
from stack.up import Stack
from tests.services.common.pg_proxy import PgProxy


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def kill9(stack: Stack, name: str) -> None:
    """SIGKILL to the service's process group: no shutdown code runs, as in a crash."""
    proc = stack.procs[name]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def restart(stack: Stack, name: str) -> None:
    """Start the service again the way the stack started it (its supervisor's job)."""
    argv = [sys.executable, "-m", "stack.cli", name]
    if BY_NAME[name].http:
        argv += ["--host", stack.host, "--port", str(stack.port)]
    logdir = Path(stack.settings.data_dir) / "logs"
    with (logdir / f"{name}.log").open("ab") as out:
        stack.procs[name] = subprocess.Popen(argv, env=stack.env(), stdout=out,
                                             stderr=subprocess.STDOUT, start_new_session=True)


class NatsServer:
    """A nats-server with JetStream that can be stopped and started on the same port and store,
    as an operator's restart does (the services reconnect; the streams are on disk)."""

    def __init__(self, store: Path) -> None:
        self.store = store
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 15.0) -> None:
        self.store.mkdir(parents=True, exist_ok=True)
        log = (self.store / "server.log").open("ab")
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-js", "-sd", str(self.store / "js"), "-a", "127.0.0.1",
             "-p", str(self.port), "--server_name", "gh-e2e-restart"],
            stdout=log, stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while not _listening(self.port):
            assert self.proc.poll() is None, "nats-server exited"
            assert time.monotonic() < deadline, "nats-server did not listen"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


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
