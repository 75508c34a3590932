"""Removing rings nobody writes any more, so that dead jobs do not fill the node's /dev/shm.

The hook removes its ring at normal exit; a process killed (kill -9, OOM, a crash) leaves it
behind, and so may a creation cut short (a hidden temporary). A file is stale when no live
process writes it, and it has stayed unchanged for ``grace_s`` since this agent first saw it so
(time for the collector to drain what the dead rank wrote last):

- no writer lock: the hook holds a POSIX write lock on its ring for its whole life, and the
  kernel drops it when the process dies, however it dies;
- and no live process with the header's pid here: rings written without the lock (the
  simulator's, an older hook) count as live while that pid exists. Across PID namespaces a pid
  may name an unrelated process; the ring then stays (a leak, never a live ring removed).

A file judged stale is renamed aside, checked to be the very file judged (a restarted rank may
have just put a new ring at that name: it is put back), and unlinked. Symlinks and what is not a
regular file are left alone; a job directory left empty for ``grace_s`` is removed. Nothing here
raises: a file that cannot be judged or removed is skipped (logged once) and tried again later.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from greyhound.hookabi.layout import HEADER_DTYPE

log = logging.getLogger(__name__)

# Rings, the hook's temporaries (.rank-N.ring.<hex>), older builds' (rank-N.ring.tmp.<pid>) and
# files this reaper set aside and did not get to unlink (.reap.<name>.<pid>).
_RING_FILE = re.compile(
    r"^(\.reap\.)?(rank-\d+\.ring|\.rank-\d+\.ring\.[0-9a-f]+|rank-\d+\.ring\.tmp\.\d+)(\.\d+)?$")
_PID_AT = int(HEADER_DTYPE.fields["pid"][1])  # type: ignore[index]
_PID_SIZE = 4


@dataclass
class _Quiet:
    """A file seen without a writer: when, and what it looked like then."""

    since: float
    size: int
    mtime_ns: int


def writer_locked(fd: int) -> bool:
    """True when another process holds a lock on the file (the hook's write lock)."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            return True
        raise
    fcntl.lockf(fd, fcntl.LOCK_UN)
    return False


def header_pid(fd: int) -> int:
    raw = os.pread(fd, _PID_SIZE, _PID_AT)
    return int.from_bytes(raw, "little", signed=True) if len(raw) == _PID_SIZE else 0


def pid_alive(pid: int) -> bool:
    return pid > 0 and os.path.exists(f"/proc/{pid}")


class RingReaper:
    """Sweeps ``shm_dir`` for stale rings; call :meth:`sweep` now and then (the agent does, from
    its loop). ``clock`` is monotonic seconds."""

    def __init__(self, shm_dir: Path, *, grace_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not grace_s > 0:
            raise ValueError("grace_s must be > 0")
        self.shm_dir = Path(shm_dir)
        self.grace_s = grace_s
        self._clock = clock
        self._quiet: dict[tuple[int, int], _Quiet] = {}  # (dev, ino) -> since when
        self._empty: dict[Path, float] = {}  # job directories seen empty, since when
        self._warned: set[Path] = set()
        self.removed = 0

    def sweep(self) -> list[Path]:
        """Remove what is stale now; returns the paths removed."""
        removed: list[Path] = []
        seen: set[tuple[int, int]] = set()
        dirs: set[Path] = set()
        try:
            jobs = [e for e in os.scandir(self.shm_dir) if e.is_dir(follow_symlinks=False)]
        except OSError:
            return removed
        now = self._clock()
        for job in jobs:
            jobdir = Path(job.path)
            dirs.add(jobdir)
            try:
                entries = [e for e in os.scandir(jobdir) if _RING_FILE.match(e.name)]
            except OSError as exc:
                self._warn(jobdir, exc)
                continue
            for entry in entries:
                path = Path(entry.path)
                try:
                    if self._stale(path, now, seen):
                        removed.append(path)
                except OSError as exc:
                    self._warn(path, exc)
            self._empty_dir(jobdir, now, bool(_listing(jobdir)))
        self._quiet = {k: v for k, v in self._quiet.items() if k in seen}
        self._empty = {d: t for d, t in self._empty.items() if d in dirs}
        self.removed += len(removed)
        return removed

    def _stale(self, path: Path, now: float, seen: set[tuple[int, int]]) -> bool:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return False
            key = (st.st_dev, st.st_ino)
            seen.add(key)
            if writer_locked(fd) or pid_alive(header_pid(fd)):
                self._quiet.pop(key, None)
                return False
        finally:
            os.close(fd)
        q = self._quiet.get(key)
        if q is None or q.size != st.st_size or q.mtime_ns != st.st_mtime_ns:
            self._quiet[key] = _Quiet(now, st.st_size, st.st_mtime_ns)
            return False
        if now - q.since < self.grace_s:
            return False
        return self._remove(path, key)

    def _remove(self, path: Path, key: tuple[int, int]) -> bool:
        """Rename aside, check it is the file judged, unlink; a file that took the name in the
        meantime is put back."""
        aside = path.with_name(f".reap.{path.name}.{os.getpid()}")
        os.rename(path, aside)
        st = os.lstat(aside)
        if (st.st_dev, st.st_ino) != key:
            with contextlib.suppress(OSError):
                os.rename(aside, path)
            return False
        os.unlink(aside)
        log.info("removed %s: no process writes it any more", path)
        return True

    def _empty_dir(self, jobdir: Path, now: float, has_files: bool) -> None:
        if has_files:
            self._empty.pop(jobdir, None)
            return
        since = self._empty.setdefault(jobdir, now)
        if now - since >= self.grace_s:
            with contextlib.suppress(OSError):  # a rank may be creating its ring there right now
                jobdir.rmdir()
                log.info("removed empty job directory %s", jobdir)

    def _warn(self, path: Path, exc: OSError) -> None:
        if path not in self._warned and exc.errno != errno.ENOENT:
            self._warned.add(path)
            log.warning("cannot judge %s for removal: %s", path, exc)


def _listing(jobdir: Path) -> list[str]:
    try:
        return os.listdir(jobdir)
    except OSError:
        return ["?"]  # unreadable: not known to be empty
