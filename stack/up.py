"""Running the whole system on one machine: embedded servers plus one process per service.

``greyhound up`` and the demo use this. Each service is its own OS process (as in production,
where compose or the operator runs them), sharing the embedded servers through URLs in the
environment. If any service dies, the stack stops rather than run half-blind. If this process
dies, killed or not, what it started ends too (stack.lifeline).

With the embedded NATS (which requires credentials) each child gets its own bus user and
password in its environment, as compose gives each container its own; credentials set in the
settings go to every child unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from pydantic_settings import BaseSettings

from services.common.data_keys import with_data_dir_keys
from services.common.db.migrate import upgrade
from services.common.embedded import EmbeddedNats, EmbeddedPostgres
from services.common.runtime import Backends, apply_streams, resolve_backends
from services.common.settings import Settings, as_env
from services.registry import BY_NAME, UP
from stack.lifeline import Lifeline

log = logging.getLogger(__name__)


def end_processes(procs: Iterable[subprocess.Popen[bytes]], timeout_s: float = 15.0) -> None:
    """SIGTERM every live one (a service saves its state and exits), wait up to ``timeout_s``
    in all, then kill the process group of those still there (each started in a session of its
    own)."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@dataclass
class Stack:
    """``services``: names from the registry (default: those ``greyhound up`` starts);
    ``service_settings``: settings objects of single services (e.g. the validator's) that the
    children get instead of what they would read from the environment."""

    settings: Settings
    host: str = "127.0.0.1"
    port: int = 8000
    services: tuple[str, ...] = UP
    service_settings: tuple[BaseSettings, ...] = ()
    backends: Backends | None = None
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    lifeline: Lifeline = field(default_factory=Lifeline)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.services) - set(BY_NAME))
        if unknown:
            raise ValueError(f"unknown service(s) {unknown}; the registry has {sorted(BY_NAME)}")

    def env(self, service: str | None = None, *, bus_user: str | None = None) -> dict[str, str]:
        """The children get this process's settings (however they were made) plus the URLs,
        and ``service``'s own bus credentials when the embedded NATS hands them out (those of
        ``bus_user`` when given: a second agent's, ``agent-<id>``)."""
        assert self.backends is not None
        env = dict(os.environ)
        for s in (self.settings, *self.service_settings):
            env.update(as_env(s))
        env["GREYHOUND_NATS_URL"] = self.backends.nats_url
        env["GREYHOUND_DATABASE_URL"] = self.backends.database_url
        env["GREYHOUND_DATA_DIR"] = str(Path(self.settings.data_dir).resolve())
        nats = self.backends.embedded_nats
        if (service is not None or bus_user is not None) and nats is not None and nats.auth \
                and self.settings.nats_user is None:
            creds = nats.credentials(bus_user if bus_user is not None
                                     else BY_NAME[str(service)].bus_user())
            env["GREYHOUND_NATS_USER"] = creds.user
            env["GREYHOUND_NATS_PASSWORD"] = creds.password
        return env

    def start(self) -> None:
        self.lifeline.start()  # first: whatever starts after it ends if this process is killed
        # On the data directory's own Postgres the services share its keys (as `greyhound up`
        # gives them): its children see a database URL, and without a key on a database URL
        # the API refuses to start (services.api.tokens.token_key).
        self.settings = with_data_dir_keys(self.settings)
        self.backends = resolve_backends(self.settings)
        for server in self.backends.started:
            if isinstance(server, EmbeddedNats) and server.pid is not None:
                self.lifeline.watch_server(server.pid)
            elif isinstance(server, EmbeddedPostgres):
                self.lifeline.watch_postgres(server.pgdata)
        upgrade(self.backends.database_url)  # once here, so services start against a ready schema
        # and the streams as these settings say (a reused data directory's brought to them):
        # the services only check them
        asyncio.run(apply_streams(self.settings, self.backends))
        for name in self.services:
            self.spawn(name)
        log.info("started %s; logs in %s", ", ".join(self.services), self.log_path("").parent)

    def spawn(self, name: str, *, instance: int = 1, port: int | None = None) -> str:
        """Start the service's process (again, after it died: a supervisor's job), with its
        own bus user, its output appended to its log; its key in ``procs`` and its log's name.
        Another instance beside the first (``instance`` 2, 3, ...; N of each, docs/scaling.md)
        is ``<name>-<instance>``, an HTTP one on ``port``, which must then differ from the
        stack's."""
        key = name if instance == 1 else f"{name}-{instance}"
        argv = [sys.executable, "-m", "stack.cli", name]
        if BY_NAME[name].http:
            argv += ["--host", self.host, "--port", str(self.port if port is None else port)]
        path = self.log_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab") as out:
            self.procs[key] = subprocess.Popen(argv, env=self.env(name), stdout=out,
                                               stderr=subprocess.STDOUT, start_new_session=True)
        self.lifeline.watch_group(self.procs[key].pid)
        return key

    def dead(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def log_path(self, name: str) -> Path:
        return Path(self.settings.data_dir) / "logs" / f"{name}.log"

    def last_error(self, name: str, tail_bytes: int = 64 * 1024) -> str | None:
        """The last ERROR record in the service's log, with the lines it spans (a service
        that refuses to start says why there), or None."""
        try:
            with self.log_path(name).open("rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - tail_bytes))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return None
        starts = [i for i, ln in enumerate(lines) if " ERROR " in ln]
        if not starts:
            return None
        record = [lines[starts[-1]]]
        for ln in lines[starts[-1] + 1:]:
            if ln[:4].isdigit():  # the next record
                break
            record.append(ln)
        return "\n".join(record[:20])

    def stop(self, timeout_s: float = 15.0) -> None:
        end_processes(self.procs.values(), timeout_s)
        self.procs.clear()
        if self.backends is not None:
            self.backends.stop()
        self.lifeline.close()

    def __enter__(self) -> Stack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_api(base: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the API at {base} did not answer within {timeout_s}s")
