"""A job's iteration times, read from the telemetry stream only while the planner needs them.

The ski-rental loss is a sum over iterations, so the planner needs a job's iteration times from
its slowdown until its incidents are over, and no other job's. Rather than a durable consumer
over every job's telemetry (which would have to receive, and ack, all of it to drop most), each
watched job gets its own short-lived ordered consumer that the server filters to the job's
subjects (``Subjects.job_iterations``), starting a little before the slowdown was detected:
memory storage, no acks, removed when the watch ends or, if the planner dies, by the server after
``inactive_threshold``. Nothing is lost by its being ephemeral: the loss it feeds is saved with
the escalation state together with the last iteration it counted, and a restarted planner reads
the job's iterations again from there (``IterationWatch.resume``: a little earlier in time, the
iterations already counted skipped by number).

Every rank of a synchronous job runs at the job's pace, so one rank's series is the job's: the
lowest rank seen, each of its iterations once, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from itertools import islice

from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext

from services.common.bus.contract import IterationBatch, Subjects
from services.common.bus.errors import describe
from services.common.bus.reader import TelemetryReader, decode

log = logging.getLogger(__name__)

OnTimes = Callable[[str, list[float]], Awaitable[None]]
WATCH_GRACE_S = 600.0  # a watched job with no escalation by then is no longer watched


def onset_lead_s(first_iteration: int, detected_iteration: int, after_s: float,
                 lookback_s: float) -> float:
    """How long before its detection a slowdown began: its slow iterations and three more,
    within ``lookback_s`` (and at least a second)."""
    span = max(detected_iteration - first_iteration + 3, 3) * max(after_s, 0.0)
    return min(lookback_s, max(span, 1.0))


class IterationSeries:
    """The job's iteration times as one rank sees them (pure bookkeeping, no I/O)."""

    def __init__(self, keep: int = 4096) -> None:
        self.rank: int | None = None
        self.last_iteration = -1
        self.count = 0
        self.recent: deque[float] = deque(maxlen=keep)
        self.stamps: deque[float] = deque(maxlen=keep)  # each kept time's batch's Unix time

    def take(self, batch: IterationBatch) -> list[float]:
        """The new iteration times in ``batch`` of the reference rank (the lowest seen)."""
        if not batch.rank:
            return []
        low = min(batch.rank)
        if self.rank is None or low < self.rank:
            self.rank, self.last_iteration = low, -1
        out: list[float] = []
        for r, it, d in zip(batch.rank, batch.iteration, batch.duration_s, strict=True):
            if r == self.rank and it > self.last_iteration:
                self.last_iteration = it
                out.append(float(d))
        self.count += len(out)
        self.recent.extend(out)
        self.stamps.extend([batch.ts] * len(out))
        return out

    def since(self, count: int, *, sent_from: float | None = None) -> list[float]:
        """The times observed after the first ``count`` (as many as are still kept); with
        ``sent_from``, only those whose batch was sent then or later."""
        n = min(self.count - count, len(self.recent))
        if n <= 0:
            return []
        skip = len(self.recent) - n
        times = islice(self.recent, skip, None)
        if sent_from is None:
            return list(times)
        return [t for t, ts in zip(times, islice(self.stamps, skip, None), strict=True)
                if ts >= sent_from]

    def position_at(self, ts: float) -> int:
        """How many times were observed before the first kept one sent at ``ts`` or later: an
        escalation fed from there counts the iterations since ``ts`` and none before."""
        after = 0
        for stamp in reversed(self.stamps):
            if stamp < ts:
                break
            after += 1
        return self.count - after

    def before(self, count: int, n: int) -> list[float]:
        """Up to ``n`` times observed just before the ``count``-th."""
        skip = self.count - count
        kept = list(self.recent)
        end = len(kept) - max(skip, 0)
        return kept[max(0, end - n):max(end, 0)]


class IterationWatch:
    """One job's watch: call :meth:`run` as a task, :meth:`stop` to end it."""

    def __init__(self, js: JetStreamContext, job: str, since: datetime, on_times: OnTimes, *,
                 fetch_timeout_s: float = 0.5, batch: int = 256) -> None:
        self.js = js
        self.job = job
        self.since = since.astimezone(UTC)
        self.on_times = on_times
        self.fetch_timeout_s = fetch_timeout_s
        self.batch = batch
        self.series = IterationSeries()
        self._stopping = asyncio.Event()
        self._last_ts: float | None = None
        # Unix time the job was last heard of (its last batch's; the watch's start before any)
        # and whether the watch has read all there is: a watch reading a backlog sees old
        # batches of a live job (services.planner.rounds.silent_jobs).
        self.heard_ts = time.time()
        self.caught_up = False

    async def _bind(self) -> TelemetryReader:
        start = self.since if self._last_ts is None else datetime.fromtimestamp(self._last_ts, UTC)
        return await TelemetryReader.open(self.js, "planner-iter", Subjects.job_iterations(self.job),
                                          start_time=start, idle_s=60.0)

    async def run(self) -> None:
        """Read until stop(); a broken consumer is re-created from the last batch's time (the
        series drops what it saw already), so the watch outlives a bus restart."""
        reader: TelemetryReader | None = None
        while not self._stopping.is_set():
            try:
                if reader is None:
                    reader = await self._bind()
                msgs = await reader.sub.fetch(self.batch, timeout=self.fetch_timeout_s)
            except (NatsTimeoutError, TimeoutError):
                self.caught_up = True
                continue
            except Exception as exc:
                if self._stopping.is_set():
                    break
                self.caught_up = False  # the bus away: the job may be talking all the same
                log.warning("iteration watch of %s: %s; re-binding", self.job, describe(exc))
                await self._drop(reader)
                reader = None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), 1.0)
                continue
            new: list[float] = []
            for msg in msgs:
                batch = decode(msg, IterationBatch)
                if batch is None:
                    continue  # the tracker dead-letters these; a reader just skips them
                self._last_ts = batch.ts
                self.heard_ts = batch.ts
                new += self.series.take(batch)
            self.caught_up = False
            if new:
                await self.on_times(self.job, new)
        await self._drop(reader)

    async def _drop(self, reader: TelemetryReader | None) -> None:
        if reader is not None:
            await reader.close()

    @property
    def cursor(self) -> tuple[int, int, float] | None:
        """The last iteration read: (reference rank, iteration, its batch's Unix time)."""
        if self.series.rank is None or self._last_ts is None:
            return None
        return self.series.rank, self.series.last_iteration, self._last_ts

    def resume(self, rank: int, iteration: int, ts: float) -> None:
        """Before :meth:`run`: the iterations up to ``iteration`` of ``rank`` were counted, the
        last of them sent at Unix time ``ts``."""
        self.series.rank, self.series.last_iteration = rank, iteration
        self.heard_ts = ts

    def silent_s(self) -> float | None:
        """How long the job has sent nothing, once the watch has read all there is."""
        return time.time() - self.heard_ts if self.caught_up else None

    def stop(self) -> None:
        self._stopping.set()


class Watches:
    """The watches of the jobs the planner escalates (or may soon: a slowdown starts one before
    its incident is validated), each feeding ``on_times``; a job nobody escalates is watched
    ``grace_s`` more (its incident may yet be validated), then its watch ends."""

    def __init__(self, js: JetStreamContext, on_times: OnTimes, *,
                 grace_s: float = WATCH_GRACE_S) -> None:
        self.js = js
        self.on_times = on_times
        self.grace_s = grace_s
        self.of: dict[str, IterationWatch] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._since: dict[str, float] = {}

    def watch(self, job: str, since: datetime) -> IterationWatch:
        """The job's watch (started from ``since`` if it has none yet), kept from now on."""
        watch = self.of.get(job)
        if watch is None:
            watch = self.of[job] = IterationWatch(self.js, job, since, self.on_times)
            self._tasks[job] = asyncio.create_task(watch.run(), name=f"planner-watch-{job}")
        self._since[job] = time.monotonic()
        return watch

    def release(self, job: str) -> None:
        """Nobody escalates the job any more: its watch ends soon (not at once: a new incident
        of the job reads the iterations just before it)."""
        self._since[job] = time.monotonic() - self.grace_s + 30.0

    def drop_idle(self, busy: set[str]) -> None:
        """End the watches of jobs not in ``busy`` whose grace ran out."""
        now = time.monotonic()
        for job in list(self.of):
            if job not in busy and now - self._since.get(job, 0.0) > self.grace_s:
                self.of.pop(job).stop()
                self._tasks.pop(job, None)

    async def close(self) -> None:
        for watch in self.of.values():
            watch.stop()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self.of.clear()
        self._tasks.clear()
