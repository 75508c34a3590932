"""Rings for the agent's tests: good ones with a steady iteration pattern, and the same ones
broken field by field (written through the file, as a corrupt or hostile process would)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from greyhound import hookabi as H

CALLS = ((H.Op.ALLREDUCE, 7, 1 << 20), (H.Op.ALLGATHER, 7, 1 << 16), (H.Op.ALLREDUCE, 9, 64))
STEP_NS = 50_000_000  # one iteration every 50 ms


def iterations(n: int, *, start_ns: int = 1_000_000_000) -> np.ndarray:
    """``n`` iterations of the same three calls, so the agent's segmenter locks on a period."""
    r = np.zeros(n * len(CALLS), H.RECORD_DTYPE)
    for i, (op, comm, count) in enumerate(CALLS):
        r["op"][i::len(CALLS)] = op
        r["comm_id"][i::len(CALLS)] = comm
        r["count"][i::len(CALLS)] = count
    r["comm_rank"] = 0
    r["nranks"] = 2
    r["peer"] = -1
    r["seq"] = np.arange(1, len(r) + 1)
    t = start_ns + np.arange(len(r)) * (STEP_NS // len(CALLS))
    r["enter_ns"] = t
    r["return_ns"] = t + 1_000
    return r


def good_ring(shm: Path, job: str, rank: int, *, capacity: int = 1024, iters: int = 40
              ) -> H.RingWriter:
    w = H.RingWriter(H.ring_path(shm, job, rank), job=job, rank=rank, host="fuzz-host", pid=0,
                     device=rank, capacity=capacity,
                     comms=[H.CommRow(7, rank, 2), H.CommRow(9, rank, 2)])
    w.append(iterations(iters))
    return w


def poke(path: Path, field: str, value: int | bytes) -> None:
    """Overwrite one header field in the file (not through a mapping)."""
    dtype, offset = H.HEADER_DTYPE.fields[field][:2]
    raw = value if isinstance(value, bytes) else np.array(value, dtype).tobytes()
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, raw, offset)
    finally:
        os.close(fd)


def header_offset(path: Path, field: str) -> int:
    """A header field's value as the file holds it."""
    dtype, offset = H.HEADER_DTYPE.fields[field][:2]
    with open(path, "rb") as f:
        f.seek(offset)
        return int(np.frombuffer(f.read(dtype.itemsize), dtype)[0])
