"""A watcher that ends what ``greyhound up`` (or the demo, or a test's stack) started once that
process dies, however it dies.

The services run in sessions of their own, so that one service's process group can be stopped
alone and a terminal's Ctrl-C reaches only ``greyhound up``, which stops them in order. So nothing
ends them when their parent is killed: after a kill -9 of ``greyhound up`` its agent, services and
nats-server ran on as orphans (an agent was found an hour later, still publishing), and the next
start met them.

The parent starts this watcher with the read end of a pipe as its stdin and keeps the write end
to itself (a pipe's ends are not inherited by the other children). It writes one line per thing
to end: ``group PID`` (a service's process group, its start time recorded so that a reused pid is
never signalled), ``server PID`` (the nats-server, ended after the services so that they can still
say goodbye on the bus), ``postgres PGDATA`` (the embedded cluster: stopped unless another live
process still holds it, as pgserver would on a clean exit). ``done`` ends the watcher with nothing
done (a clean stop did it all). When the parent dies the kernel closes the pipe and the watcher
reads its end: each group gets SIGTERM (a service's clean shutdown: the tracker saves its jobs),
SIGKILL after a grace, then the server the same way, then the cluster.

A pipe rather than ``PR_SET_PDEATHSIG``: that fires when the *thread* that forked the child ends
(a service a helper thread restarted would die with the thread), exists only on Linux, and cannot
reach postgres, which is pg_ctl's daemon and no one's child.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

GRACE_S = 10.0  # SIGTERM to SIGKILL: a service's shutdown (a tracker's save) takes well under it


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command (Linux), None where there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (Linux's /proc), None where unknown: with the
    pid it names one process, never a later one given the same pid."""
    fields = _stat(pid)
    return fields[19] if fields else None


def running(pid: int, started: str | None = None) -> bool:
    """The process runs (a zombie no one has reaped yet has ended) and, with ``started``, is
    the one that started then."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or not ours
        return False
    fields = _stat(pid)
    if fields is None:
        return started is None and sys.platform != "linux"
    return fields[0] != "Z" and (started is None or fields[19] == started)


@dataclass
class Lifeline:
    """The parent's end: start it before the first child, ``watch`` each, ``close`` on a clean
    stop."""

    _proc: subprocess.Popen[bytes] | None = None
    _pipe: IO[str] | None = None

    def start(self) -> None:
        read, write = os.pipe()  # both non-inheritable; stdin= hands the read end over
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "stack.lifeline"], stdin=read,
                                          start_new_session=True)
        finally:
            os.close(read)
        self._pipe = os.fdopen(write, "w", buffering=1)

    @property
    def pid(self) -> int | None:
        """The watcher's pid while it runs."""
        return self._proc.pid if self._proc is not None else None

    def _say(self, line: str) -> None:
        if self._pipe is not None:
            with contextlib.suppress(OSError):
                self._pipe.write(line + "\n")

    def watch_group(self, pid: int) -> None:
        self._say(f"group {pid} {start_time(pid) or '-'}")

    def watch_server(self, pid: int) -> None:
        self._say(f"server {pid} {start_time(pid) or '-'}")

    def watch_postgres(self, pgdata: Path) -> None:
        self._say(f"postgres {pgdata.resolve()}")

    def close(self) -> None:
        """Everything was stopped cleanly: the watcher leaves without doing anything."""
        self._say("done")
        if self._pipe is not None:
            with contextlib.suppress(OSError):
                self._pipe.close()
            self._pipe = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None


@dataclass
class _Watched:
    groups: dict[int, str | None] = field(default_factory=dict)
    servers: dict[int, str | None] = field(default_factory=dict)
    clusters: list[Path] = field(default_factory=list)

    def take(self, line: str) -> bool:
        """One line from the parent; False on ``done``."""
        word, _, rest = line.strip().partition(" ")
        if word == "done":
            return False
        if word in ("group", "server"):
            pid, _, started = rest.partition(" ")
            into = self.groups if word == "group" else self.servers
            into[int(pid)] = None if started in ("", "-") else started
        elif word == "postgres":
            self.clusters.append(Path(rest))
        return True


def _end(pids: dict[int, str | None], group: bool, first: int = signal.SIGTERM) -> None:
    """``first`` to each that is still the process it was, SIGKILL to those left after
    GRACE_S."""
    def send(sig: int) -> list[int]:
        sent = []
        for pid, started in pids.items():
            if running(pid, started):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    (os.killpg if group else os.kill)(pid, sig)
                sent.append(pid)
        return sent

    left = send(first)
    deadline = time.monotonic() + GRACE_S
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if running(p, pids[p])]
    if left:
        send(signal.SIGKILL)


def _stop_cluster(pgdata: Path) -> None:
    """What pgserver does when its last user exits, for a parent that could not: its pid leaves
    the cluster's list of users (a dead one left there would keep the cluster running for ever),
    and with no live user left the postmaster gets a fast shutdown (SIGINT)."""
    users = pgdata / ".handle_pids.json"
    try:
        pids = [int(p) for p in json.loads(users.read_text())]
    except (OSError, ValueError, TypeError):
        pids = []
    alive = [p for p in pids if running(p, None)]
    if alive != pids:
        with contextlib.suppress(OSError):
            users.write_text(json.dumps(alive))
    if alive:
        return
    try:
        postmaster = int((pgdata / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    _end({postmaster: start_time(postmaster)}, group=False, first=signal.SIGINT)


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's terminal is not ours to obey
    watched = _Watched()
    for line in sys.stdin:
        if not watched.take(line):
            return 0
    # the parent is gone without a word: end what it started, services first
    _end(watched.groups, group=True)
    _end(watched.servers, group=False)
    for pgdata in watched.clusters:
        _stop_cluster(pgdata)
    return 0


if __name__ == "__main__":
    sys.exit(main())
