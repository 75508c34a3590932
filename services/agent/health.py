"""What the agent knows about rings it cannot serve: counted, logged once, retried later.

A ring that fails its checks (or fails while it is read) is one rank's problem, not the node's:
the agent reports it and goes on serving every other ring. It is logged once per file and
reason (not once a poll), counted by reason, listed in :meth:`RingHealth.snapshot` (the agent's
status, which its periodic status line and tests read), and tried again after ``retry_s`` in
case it was caught mid-change; a file replaced at the same path is tried at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from greyhound.hookabi import FileId, RingError

log = logging.getLogger(__name__)

# Bad rings remembered at once; beyond, the oldest entries go (they are tried again, then).
MAX_BAD = 4096


@dataclass(frozen=True, slots=True)
class BadRing:
    file_id: FileId | None
    reason: str
    detail: str
    retry_at: float


@dataclass
class RingHealth:
    """Shared by the collectors of one agent."""

    retry_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    errors: dict[str, int] = field(default_factory=dict)  # reason -> times seen
    bad: dict[Path, BadRing] = field(default_factory=dict)

    def report(self, path: Path, file_id: FileId | None, exc: BaseException) -> None:
        """``path`` (the file ``file_id``) failed with ``exc``; skip it until the retry."""
        reason = exc.reason if isinstance(exc, RingError) else type(exc).__name__
        self.errors[reason] = self.errors.get(reason, 0) + 1
        old = self.bad.get(path)
        if old is None or old.file_id != file_id or old.reason != reason:
            if isinstance(exc, RingError | OSError):
                log.warning("ring %s skipped (%s): %s", path, reason, exc)
            else:  # not the ring's fault: a bug on our side, worth its traceback once
                log.error("ring %s skipped after an unexpected error", path, exc_info=exc)
        self.bad[path] = BadRing(file_id, reason, str(exc)[:500], self.clock() + self.retry_s)
        while len(self.bad) > MAX_BAD:
            del self.bad[next(iter(self.bad))]

    def skip(self, path: Path, file_id: FileId) -> bool:
        """True while ``path`` is the file that failed and its retry time has not come."""
        bad = self.bad.get(path)
        return bad is not None and bad.file_id == file_id and self.clock() < bad.retry_at

    def healed(self, path: Path) -> None:
        if self.bad.pop(path, None) is not None:
            log.info("ring %s is served again", path)

    def forget(self, keep: Callable[[Path], bool]) -> None:
        """Drop entries of files that are gone (``keep`` says which paths still exist)."""
        for path in [p for p in self.bad if not keep(p)]:
            del self.bad[path]

    def snapshot(self) -> dict[str, object]:
        return {"bad_rings": {str(p): b.reason for p, b in self.bad.items()},
                "ring_errors": dict(self.errors)}
