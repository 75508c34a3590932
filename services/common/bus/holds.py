"""Which jobs wait behind a message of theirs that failed, so that one job's trouble stays its own.

A consumer handles a fetched batch one message after another. When a message's handler fails
transiently it is naked with a delay and comes back later; without a hold, the next messages of
the same job would run their handler at once, each failing the same way (the same missing
state, the same unreachable dependency), each costing the handler's time: a few hundred such
messages of one job, each waiting out a timeout, hold up every other job of the batch for many
minutes and outlive their own ack wait. And the ones that do succeed overtake the failed one,
which is out of order for a consumer that keeps per-job state (the tracker).

So a transient failure holds the message's job (its subject's job token; the subject itself
where there is none) until the failed message is due back: the job's later messages are naked
at once for the same moment, without running the handler, and the other jobs go on. The first
message of the job that succeeds, or the held one reaching the dead-letter path, releases the
hold. Each held message still spends one delivery per round, so a job whose failures never end
reaches its bound (max deliver) like any message and goes to the dead-letter queue.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from services.common.bus.contract import Subjects

# A follower comes back this much after the message it waits behind, so that the held message
# is redelivered first.
FOLLOW_S = 0.25
# A hold whose message has not come back this long after it was due is dropped (the message
# went elsewhere: dead-lettered by another process, or its redelivery was lost).
STALE_S = 5.0


def job_key(subject: str) -> str:
    """The job a message belongs to: its subject's job token, else the subject itself."""
    try:
        return Subjects.job_of(subject)
    except ValueError:
        return subject


@dataclass(frozen=True, slots=True)
class Hold:
    until: float  # time.monotonic() at which the failed message is due back
    subject: str  # the failed message's subject
    seq: int | None  # its stream sequence (None: the server did not say)
    reason: str  # why it failed, for the followers' log and dead letters

    def delay_s(self, now: float) -> float:
        return max(self.until - now, 0.0) + FOLLOW_S


class Holds:
    """The holds of one consumer, for a bounded number of jobs at a time."""

    def __init__(self, limit: int = 10_000) -> None:
        self._limit = limit
        self._by_key: dict[str, Hold] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def hold(self, subject: str, seq: int | None, delay_s: float, reason: str) -> None:
        """The message ``seq`` on ``subject`` failed and comes back in ``delay_s``."""
        key = job_key(subject)
        now = time.monotonic()
        if key not in self._by_key and len(self._by_key) >= self._limit:
            self._expire(now)
            if len(self._by_key) >= self._limit:
                return  # too many jobs in trouble at once: the rest are retried one by one
        self._by_key[key] = Hold(now + delay_s, subject, seq, reason)

    def release(self, subject: str, seq: int | None) -> None:
        """Message ``seq`` on ``subject`` succeeded or left for good: its job's hold is over,
        unless it was older than the held message."""
        key = job_key(subject)
        h = self._by_key.get(key)
        if h is not None and (seq is None or h.seq is None or seq >= h.seq):
            del self._by_key[key]

    def of(self, subject: str, seq: int | None) -> Hold | None:
        """The hold that message ``seq`` on ``subject`` must wait behind, or None when it may
        run: its job is not held, it is the held message itself (or an older one), or the held
        message is long overdue."""
        key = job_key(subject)
        h = self._by_key.get(key)
        if h is None:
            return None
        if seq is not None and h.seq is not None and seq <= h.seq:
            return None
        now = time.monotonic()
        if now > h.until + STALE_S or (h.seq is None and now >= h.until):
            del self._by_key[key]
            return None
        return h

    def _expire(self, now: float) -> None:
        for key in [k for k, h in self._by_key.items() if now > h.until + STALE_S]:
            del self._by_key[key]
