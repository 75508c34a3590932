"""Two stacks on one machine: what they would share by default, refused before either starts.

``greyhound up`` and ``greyhound sim run`` both serve the API on port 8000 and run an agent over
``/dev/shm/greyhound``. A second one on the same port dies in its API child with a message in
a log; a second one on the same ring directory is worse, silently: its agent reads every job's
rings there, the first stack's included, and publishes them as its own. So each stack claims its
ring directory for as long as it runs (an advisory lock on a file next to it, which the OS
releases when the process ends, even killed) and checks that its port is free, and a second one
is told which setting to change.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path


class Collision(RuntimeError):
    """Another stack (or program) holds what this one needs; the message says what to change."""


def check_port(host: str, port: int) -> None:
    """Refuse a port something already listens on (bound as uvicorn binds it, SO_REUSEADDR, so a
    port left in TIME_WAIT by a stack that just stopped is not mistaken for a taken one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise Collision(
                f"port {port} on {host} is already in use (another greyhound up or sim run?): "
                "pass --port (or set GREYHOUND_API_PORT) for this one") from None


def claim_file(shm_dir: Path) -> Path:
    """Next to the ring directory, not in it: the hook makes that directory for every user."""
    shm = shm_dir.resolve()
    return shm.parent / f".{shm.name}.claim"


@contextlib.contextmanager
def ring_dir_claim(shm_dir: Path, data_dir: Path) -> Iterator[None]:
    """Hold ``shm_dir`` for this stack while the block runs; Collision if another holds it."""
    path = claim_file(shm_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Collision(_held_by(fd, shm_dir)) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(),
                                 "data_dir": str(Path(data_dir).resolve())}).encode())
        yield
    finally:
        os.close(fd)  # releases the lock


def _held_by(fd: int, shm_dir: Path) -> str:
    try:
        owner = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        owner = {}
    who = (f"the stack of data directory {owner.get('data_dir')} (pid {owner.get('pid')})"
           if owner else "another stack")
    return (f"the ring directory {shm_dir} is in use by {who}: this stack's agent would read "
            "that stack's rings as its own; set GREYHOUND_SHM_DIR to another directory for this "
            "one (e.g. /dev/shm/greyhound-2), and run training jobs with the same value")


@contextlib.contextmanager
def claim(*, shm_dir: Path, data_dir: Path, host: str, port: int) -> Iterator[None]:
    """What a stack on this machine checks and holds before it starts its services."""
    with ring_dir_claim(shm_dir, data_dir):
        check_port(host, port)
        yield
