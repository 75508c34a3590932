"""One ring file mapped into memory, checked against the layout before any view is made.

The writer's side (the simulator's RingWriter, tests that forge rings) maps its own files. The
agent never maps a ring it did not write: it reads through greyhound.hookabi.ringfile, since a
mapping of a file that another process shrinks faults with SIGBUS.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from greyhound.hookabi.layout import (
    COMM_DTYPE,
    CONTROL_DTYPE,
    HEADER_BYTES,
    HEADER_DTYPE,
    MAX_COMMS,
    PROGRESS_DTYPE,
    RECORD_DTYPE,
    RingHeader,
)
from greyhound.hookabi.validation import RingError, check_header


class RingMapping:
    """A shared mapping of one ring file with numpy views of its regions (header, control
    block, comm table, records), for the process that writes the ring."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise RingError(path, "truncated", f"{size} bytes is too small for a ring")
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.hdr = np.ndarray((), HEADER_DTYPE, buffer=self.mm, offset=0)
        try:
            g = check_header(self.hdr, size, path)
        except RingError:
            del self.hdr
            self.mm.close()
            raise
        cap = self.capacity = g.capacity
        self.ctl = np.ndarray((), CONTROL_DTYPE, buffer=self.mm, offset=g.control_offset)
        self.comm_table = np.ndarray((MAX_COMMS,), COMM_DTYPE, buffer=self.mm,
                                     offset=g.comms_offset)
        self.progress = np.ndarray((), PROGRESS_DTYPE, buffer=self.mm, offset=g.progress_offset)
        self.records = np.ndarray((cap,), RECORD_DTYPE, buffer=self.mm, offset=g.records_offset)

    def header(self) -> RingHeader:
        h = self.hdr
        return RingHeader(
            version=int(h["version"]),
            job=bytes(h["job"].item()).decode(errors="replace"),
            rank=int(h["rank"]),
            host=bytes(h["host"].item()).decode(errors="replace"),
            pid=int(h["pid"]),
            device=int(h["device"]),
            capacity=int(h["capacity"]),
            head=int(h["head"]),
            dropped=int(h["dropped"]),
            mono_anchor_ns=int(h["mono_anchor_ns"]),
            wall_anchor_ns=int(h["wall_anchor_ns"]),
        )

    def slice_copy(self, start: int, n: int) -> np.ndarray:
        """Records [start, start + n) copied out of the ring, at most two slices (wrap)."""
        cap = self.capacity
        s = start & (cap - 1)
        if s + n <= cap:
            return self.records[s : s + n].copy()
        return np.concatenate((self.records[s:], self.records[: s + n - cap]))

    def close(self) -> None:
        for name in ("hdr", "ctl", "comm_table", "progress", "records"):
            self.__dict__.pop(name, None)
        self.mm.close()
