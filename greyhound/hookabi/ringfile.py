"""One ring file read and written through its descriptor (pread/pwrite), never mapped.

The agent's side of a ring goes through here because the file belongs to another process: a
shared mapping of a file that shrinks (an old hook re-creating its ring in place with O_TRUNC,
an operator's truncate, a full tmpfs) kills the reader with SIGBUS at its next touch, which no
Python code can catch. A pread past the end comes back short instead, and that becomes a
RingError the agent reports. Every read copies, so nothing here aliases the writer's memory.

The file is opened without following a symlink and must be a regular file: a privileged agent
must never be led into writing its cursor into some other file. Opened relative to its job
directory's descriptor (``dir_fd``), no component of the path is a symlink either.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from greyhound.hookabi.layout import (
    COMM_DTYPE,
    CONTROL_DTYPE,
    HEADER_DTYPE,
    MAX_COMMS,
    PROGRESS_DTYPE,
    RECORD_DTYPE,
)
from greyhound.hookabi.validation import Geometry, RingError, check_header

_HEAD = HEADER_DTYPE.fields["head"][1]  # type: ignore[index]
# host_ver, gpu_ver, life_op, life_ver: 16 bytes, of which the three seqlock words
_VERS = COMM_DTYPE.fields["host_ver"][1]  # type: ignore[index]
_U32X4 = np.dtype(("<u4", (4,)))
_CONSUMED = HEADER_DTYPE.fields["consumed"][1]  # type: ignore[index]
_MASK_EXTRA = PROGRESS_DTYPE.fields["mask_extra"][1]  # type: ignore[index]
_U64 = np.dtype("<u8")


@dataclass(frozen=True, slots=True)
class FileId:
    """A file's identity (device, inode): a rank that restarts writes a new file at the same
    path, and whatever the agent holds for the old one must not reach the new one, or back."""

    dev: int
    ino: int

    @staticmethod
    def of(st: os.stat_result) -> FileId:
        return FileId(int(st.st_dev), int(st.st_ino))


class RingFile:
    """A ring file checked against the layout on open, then read by region with pread; with
    ``dir_fd``, its name is opened in that directory (the path names it in logs)."""

    def __init__(self, path: Path, *, dir_fd: int | None = None) -> None:
        self.path = Path(path)
        try:
            fd = os.open(self.path.name if dir_fd is not None else self.path,
                         os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
                raise RingError(path, "not_a_file", "is a symbolic link") from exc
            raise
        self._fd = fd
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise RingError(path, "not_a_file", "is not a regular file")
            self.id = FileId.of(st)
            self.owner = int(st.st_uid)
            self.geometry: Geometry = check_header(self._read(0, HEADER_DTYPE, ()), st.st_size,
                                                   self.path)
        except BaseException:
            self.close()
            raise

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def _fileno(self) -> int:
        if self._fd < 0:
            # never a stale number: a closed descriptor's number may belong to another file now
            raise RingError(self.path, "closed", "the ring was closed")
        return self._fd

    def size(self) -> int:
        return int(os.fstat(self._fileno()).st_size)

    def _read(self, offset: int, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
        out = np.empty(shape, dtype)
        want = out.nbytes
        got = os.preadv(self._fileno(), [out.data.cast("B")], offset) if want else 0
        if got != want:
            raise RingError(self.path, "truncated", f"read {got} of {want} bytes at offset "
                                                    f"{offset}: the file shrank under the reader")
        return out

    def _write(self, offset: int, data: np.ndarray) -> None:
        raw = data.tobytes()
        if os.pwrite(self._fileno(), raw, offset) != len(raw):
            raise RingError(self.path, "truncated", f"short write at offset {offset}")

    # ---- header ------------------------------------------------------------------------------

    def header(self) -> np.ndarray:
        """A fresh copy of the header (HEADER_DTYPE scalar)."""
        return self._read(0, HEADER_DTYPE, ())

    def head(self) -> int:
        return int(self._read(_HEAD, _U64, ()))

    def consumed(self) -> int:
        return int(self._read(_CONSUMED, _U64, ()))

    def set_consumed(self, cursor: int) -> None:
        self._write(_CONSUMED, np.array(cursor, _U64))

    # ---- regions -----------------------------------------------------------------------------

    def records(self, start: int, n: int) -> np.ndarray:
        """Records [start, start + n) in ring order (at most two reads when they wrap);
        ``n`` must not exceed the capacity."""
        g = self.geometry
        if not 0 <= n <= g.capacity:
            raise ValueError(f"cannot read {n} records from a ring of {g.capacity}")
        s = start & (g.capacity - 1)
        first = min(n, g.capacity - s)
        out = self._read(g.record_offset(start), RECORD_DTYPE, (first,))
        if first == n:
            return out
        rest = self._read(g.records_offset, RECORD_DTYPE, (n - first,))
        return np.concatenate((out, rest))

    def comm_table(self) -> np.ndarray:
        return self._read(self.geometry.comms_offset, COMM_DTYPE, (MAX_COMMS,))

    def comm_row(self, index: int) -> np.ndarray:
        """One comm-table row (COMM_DTYPE scalar)."""
        if not 0 <= index < MAX_COMMS:
            raise ValueError(f"comm row {index} is outside 0..{MAX_COMMS - 1}")
        return self._read(self.geometry.comms_offset + index * COMM_DTYPE.itemsize, COMM_DTYPE, ())

    def comm_versions(self, index: int) -> tuple[int, int, int]:
        """A row's seqlock words (host_ver, gpu_ver, life_ver), read together on their own."""
        if not 0 <= index < MAX_COMMS:
            raise ValueError(f"comm row {index} is outside 0..{MAX_COMMS - 1}")
        v = self._read(self.geometry.comms_offset + index * COMM_DTYPE.itemsize + _VERS, _U32X4, ())
        return int(v[0]), int(v[1]), int(v[3])

    def progress(self) -> np.ndarray:
        """The profiler plugin's region (PROGRESS_DTYPE scalar): its counters only grow, so one
        copy is a usable sample (each word is whole; slots may be a step apart)."""
        return self._read(self.geometry.progress_offset, PROGRESS_DTYPE, ())

    def write_mask_extra(self, mask: int) -> None:
        """Ask the plugin for event classes on top of its default ones (NCCL's mask bits)."""
        self._write(self.geometry.progress_offset + _MASK_EXTRA, np.array(mask, np.dtype("<u4")))

    def control_block(self) -> np.ndarray:
        return self._read(self.geometry.control_offset, CONTROL_DTYPE, ())

    def write_control(self, offset: int, value: np.ndarray) -> None:
        """Write ``value`` at ``offset`` bytes into the control block (a field or a slot)."""
        if not 0 <= offset <= CONTROL_DTYPE.itemsize - value.nbytes:
            raise ValueError(f"{value.nbytes} bytes at {offset} fall outside the control block")
        self._write(self.geometry.control_offset + offset, value)

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)
