"""Shared helpers of the native tests."""

from __future__ import annotations

import time
from pathlib import Path

from greyhound import hookabi as H


def wait_rings(shm: Path, job: str, n: int, timeout: float = 20.0) -> list[Path]:
    """The job's n ring files, once the hook in each rank has created its own."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rings = H.list_rings(shm, job)
        if len(rings) == n:
            return rings
        time.sleep(0.02)
    raise TimeoutError(f"{n} rings for {job} did not appear")
