"""The node agent: drains every rank's ring on this host and publishes to the bus.

It never touches the training processes beyond reading their rings (and, later, writing their
control blocks), so a dead bus costs telemetry, never the job: publishing failures are logged and
the batch is retried on the next tick, bounded so memory cannot grow without limit.

A monitor must outlive what it watches: one ring that is corrupt, truncated or hostile is
reported and skipped (see collector and health), a batch that fails the contract is dropped and
counted, and no failure of one step of a tick ends the loop. Jobs whose rings are all gone are
evicted, with their control subscriptions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from nats.aio.client import Client as NATS
from nats.errors import MaxPayloadError
from nats.js import JetStreamContext
from pydantic import ValidationError

from greyhound.ids import check_token
from services.agent.collector import Collector, ProgressCols, RankIteration, RankStream
from services.agent.control import AgentControl
from services.agent.health import RingHealth
from services.agent.nvml import GpuMonitor, NvmlSampler
from services.agent.reaper import RingReaper
from services.agent.settings import AgentSettings
from services.common.bus.auth import BusAuthError, agent_of_user, agent_user, default_agent_id
from services.common.bus.client import publish
from services.common.bus.contract import (
    AgentHello,
    CollectiveBatch,
    Columnar,
    CounterBatch,
    IterationBatch,
    Message,
    ProgressRows,
    RankInfo,
    Subjects,
    split_columns,
)
from services.common.runtime import ServiceContext

log = logging.getLogger(__name__)

B = TypeVar("B", bound=Columnar)

MAX_BACKLOG = 10_000  # unpublished messages kept while the bus is unreachable
# Rows per CollectiveBatch: ~0.5 MB of JSON, under NATS's default 1 MB max_payload. A server with
# a smaller limit still gets everything: flush() halves a batch the server refuses as too large.
COLLECTIVE_ROWS = 4_000
STATUS_EVERY_S = 60.0  # a status line at most this often, when rings are bad or errors grew
_NODE = re.compile(r"node(\d+)$")


def node_of(host: str) -> int | None:
    """The node index in host names like ``sim-node3`` or ``node12``; None for other names."""
    m = _NODE.search(host.split(".")[0])
    return int(m.group(1)) if m else None


class NodeAgent:
    def __init__(self, shm_dir: Path, js: JetStreamContext, *, agent_id: str,
                 settings: AgentSettings, jobs: list[str] | None = None) -> None:
        self.shm_dir = Path(shm_dir)
        self.settings = settings
        self.js = js
        self.agent_id = check_token(agent_id, "agent id")
        self.fixed_jobs = jobs
        self.health = RingHealth()
        self.collectors: dict[str, Collector] = {}
        self.backlog: deque[tuple[str, Message]] = deque(maxlen=MAX_BACKLOG)
        self.published = 0
        self.dropped = 0  # messages no server could take (a single row over max_payload)
        self.reaper = RingReaper(self.shm_dir, grace_s=self.settings.ring_grace_s)
        self.malformed = 0  # batches that failed the contract (nonsense from a ring)
        self.loop_errors = 0  # steps of a tick that raised (a bug: logged, the loop goes on)
        self._ignored: set[str] = set()
        self._hello_at: dict[str, float] = {}  # when each job's ranks were last announced
        self._status_at = 0.0
        self._status_seen: dict[str, int] = {}
        self._publish_failures = 0  # in a row (the bus away, or the streams not declared yet)
        self.invalid_rows = 0  # rows outside the bus contract's bounds, left out
        self.gpu: GpuMonitor | None = None
        if self.settings.nvml:
            self.gpu = GpuMonitor(NvmlSampler(self.settings.nvml_lib, host=socket.gethostname()),
                                  agent_id=self.agent_id, sample_s=self.settings.gpu_s,
                                  xid_poll_s=self.settings.xid_poll_s)

    def status(self) -> dict[str, Any]:
        """What the agent serves and what it could not: its status line, and tests, read it."""
        return {"agent_id": self.agent_id, "jobs": len(self.collectors),
                "rings": sum(len(c.streams) for c in self.collectors.values()),
                "published": self.published, "backlog": len(self.backlog),
                "dropped": self.dropped, "malformed": self.malformed,
                "loop_errors": self.loop_errors, "invalid_rows": self.invalid_rows,
                **self.health.snapshot()}

    def _job_dirs(self) -> list[str]:
        if self.fixed_jobs is not None:
            return self.fixed_jobs
        try:  # a symlink is no job directory (another user's, pointing anywhere)
            return sorted(e.name for e in os.scandir(self.shm_dir)
                          if e.is_dir(follow_symlinks=False))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _valid_job(self, job: str) -> bool:
        try:
            check_token(job, "job id")
        except ValueError:
            if job not in self._ignored and len(self._ignored) < 1000:
                self._ignored.add(job)
                log.warning("ignoring ring directory %r: not a valid job id", job)
            return False
        return True

    def _queue(self, subject: str, build: Callable[[], Message]) -> None:
        """Queue the message ``build`` makes now; one that fails the contract (nonsense the
        rings let through) is dropped and counted, never raised into the loop."""
        try:
            self.backlog.append((subject, build()))
        except (ValidationError, ValueError) as exc:
            self._malformed(exc)

    def _malformed(self, exc: Exception) -> None:
        self.malformed += 1
        if self.malformed == 1 or self.malformed % 100 == 0:
            log.warning("dropped a malformed message (%d so far): %s", self.malformed,
                        str(exc)[:300])

    def scan(self) -> None:
        jobs = [j for j in self._job_dirs() if self._valid_job(j)]
        now = time.monotonic()
        for job in jobs:
            col = self.collectors.get(job) or Collector(self.shm_dir, job, health=self.health)
            new = col.scan()
            # Ranks whose hook decided what its GPU view rests on since they were announced.
            learned = [s for s in col.streams.values() if s not in new and s.gpu_api_learned()]
            if col.streams:
                self.collectors[job] = col
            # Every live rank again now and then: the tracker lets another agent take a rank
            # only once this one stopped announcing it (a job restarted on other nodes).
            if now >= self._hello_at.get(job, 0.0) + self.settings.hello_s:
                learned = [s for s in col.streams.values() if s not in new and not s.ended]
            if new or learned:
                self._hello_at[job] = now
                self._queue(Subjects.hello(job, self.agent_id),
                            partial(self._hello, job, [*new, *learned]))
        for job in [j for j in self.collectors if j not in jobs]:
            self.collectors[job].scan()  # its directory is gone: every ring retires

    def _hello(self, job: str, new: list[RankStream]) -> AgentHello:
        ranks = [RankInfo(rank=s.rank, host=s.reader.header.host, pid=s.reader.header.pid,
                          device=s.reader.header.device, node=node_of(s.reader.header.host))
                 for s in new]
        off = sorted(s.rank for s in new if s.reader.header.marks_off)
        if off:
            log.warning("job %s: rank(s) %s have no CUDA runtime nor driver API the hook can use: "
                        "no GPU completion marks, their hang watch and timings rest on host time",
                        job, off[:16])
        return AgentHello(job_id=job, agent_id=self.agent_id, host=socket.gethostname(),
                          ranks=ranks, marks_off=off)

    def collect_iterations(self) -> None:
        for job, col in list(self.collectors.items()):
            its: list[RankIteration] = col.drain()
            self.collect_profiled(job, col)
            batch = self._valid(IterationBatch, job, {
                "rank": [i.rank for i in its], "iteration": [i.iteration for i in its],
                "end_ns": [i.end_wall_ns for i in its], "duration_s": [i.duration_s for i in its]
            }) if its else None
            if batch is not None:
                self.backlog.append((Subjects.iterations(job, self.agent_id), batch))
            if not col.streams:  # every ring of the job is gone and drained: evict it
                col.close()
                del self.collectors[job]
                self._hello_at.pop(job, None)

    def _valid(self, model: type[B], job: str, columns: dict[str, list[Any]],
               **envelope: Any) -> B | None:
        """The batch less the rows outside the contract's bounds (a negative iteration time, a
        garbage counter): one bad row costs that row, never the batch or the agent; a batch
        that still fails the contract is dropped and counted, never raised into the loop."""
        try:
            batch, bad = model.keep_valid(columns, job_id=job, agent_id=self.agent_id, **envelope)
        except (ValidationError, ValueError) as exc:
            self._malformed(exc)
            return None
        if bad:
            self.invalid_rows += bad
            log.warning("job %s: %d %s row(s) outside the bus contract's bounds left out (%d so "
                        "far)", job, bad, model.__name__, self.invalid_rows)
        return batch

    def collect_profiled(self, job: str, col: Collector) -> None:
        """Every collective of ranks in profile mode (switched through control), wall clock."""
        rows = col.take_profiled()
        for part in rows.chunks(COLLECTIVE_ROWS):
            batch = self._valid(CollectiveBatch, job, vars(part))
            if batch is not None:
                self.backlog.append((Subjects.collectives(job, self.agent_id), batch))

    def _progress(self, job: str, cols: ProgressCols) -> ProgressRows | None:
        """The plugin's counters as a message part, None when there are none; rows outside the
        contract are dropped alone, never the counters they travel with."""
        if not cols.rank:
            return None
        try:
            return ProgressRows.model_validate(vars(cols))
        except ValidationError as exc:
            self.invalid_rows += len(cols.rank)
            log.warning("job %s: %d progress row(s) outside the bus contract left out: %s", job,
                        len(cols.rank), str(exc)[:200])
            return None

    def collect_counters(self) -> None:
        now_mono = time.monotonic_ns()
        for job, col in list(self.collectors.items()):
            rows = col.counters(now_mono)
            if not rows.rank:
                continue
            progress = self._progress(job, col.progress(now_mono))
            batch = self._valid(CounterBatch, job, vars(rows), sampled_ns=time.time_ns(),
                                progress=progress)
            if batch is not None:
                self.backlog.append((Subjects.counters(job, self.agent_id), batch))

    async def flush(self) -> None:
        while self.backlog:
            subject, msg = self.backlog[0]
            try:
                await publish(self.js, subject, msg)
            except MaxPayloadError:
                # Over the server's max_payload: retrying as is would block every later message.
                self.backlog.popleft()
                halves = split_columns(msg)
                if halves is None:
                    self.dropped += 1
                    log.error("dropped a %s message to %s: one row is over the server's "
                              "max_payload", type(msg).__name__, subject)
                else:
                    self.backlog.extendleft((subject, h) for h in reversed(halves))
                continue
            except Exception as exc:
                self._publish_failures += 1
                if self._publish_failures == 1 or self._publish_failures % 200 == 0:
                    log.warning("publish to %s failed (%s, %d in a row); %d messages waiting",
                                subject, exc, self._publish_failures, len(self.backlog))
                return
            self.backlog.popleft()
            self.published += 1
            if self._publish_failures:
                log.info("publishing again after %d failures", self._publish_failures)
                self._publish_failures = 0

    def _step_failed(self, step: str) -> None:
        self.loop_errors += 1
        if self.loop_errors == 1 or self.loop_errors % 100 == 0:
            log.exception("agent step %s failed (%d failures so far); the loop goes on", step,
                          self.loop_errors)

    def _log_status(self, now: float) -> None:
        """A status line once a minute at most, and only when something is wrong or changed."""
        if now < self._status_at:
            return
        self._status_at = now + STATUS_EVERY_S
        seen = {**self.health.errors, "malformed": self.malformed, "loop": self.loop_errors,
                "dropped": self.dropped}
        if (seen != self._status_seen and any(seen.values())) or self.health.bad:
            self._status_seen = seen
            st = self.status()
            log.warning("agent %s: %d rings of %d jobs served, %d skipped %s, errors %s, "
                        "%d malformed, %d dropped", self.agent_id, st["rings"], st["jobs"],
                        len(self.health.bad), sorted(set(st["bad_rings"].values()))[:8],
                        st["ring_errors"], self.malformed, self.dropped)

    async def run(self, stop: asyncio.Event, *, nc: NATS | None = None,
                  control: AgentControl | None = None) -> None:
        """Drain and publish until ``stop``; with ``control`` (and its connection ``nc``), also
        answer control requests for every job found. A step that raises is logged and counted,
        and the next tick runs anyway: the agent is the one part that must not stop."""
        next_scan = next_counters = next_reap = 0.0
        gpu_task = None
        if self.gpu is not None:
            gpu_task = asyncio.create_task(self.gpu.run(
                stop, self.collectors, lambda subject, msg: self.backlog.append((subject, msg))))
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_reap:  # rings of killed ranks would otherwise fill /dev/shm
                try:
                    self.reaper.sweep()
                except Exception:
                    self._step_failed("reap")
                next_reap = now + min(30.0, self.settings.ring_grace_s / 4)
            if now >= next_scan:
                next_scan = now + 1.0
                try:
                    self.scan()
                    if control is not None and nc is not None:
                        await control.sync_jobs(nc)
                except Exception:
                    self._step_failed("scan")
            try:
                self.collect_iterations()
                if now >= next_counters:
                    next_counters = now + self.settings.counters_s
                    self.collect_counters()
            except Exception:
                self._step_failed("collect")
            await self.flush()
            self._log_status(now)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.settings.poll_s)
        try:
            self.collect_iterations()
        except Exception:
            self._step_failed("collect")
        if gpu_task is not None:
            await asyncio.gather(gpu_task, return_exceptions=True)
        await self.flush()
        for col in self.collectors.values():
            col.close()


async def run_agent(ctx: ServiceContext, stop: asyncio.Event, *, job: list[str] | None = None,
                    agent_id: str | None = None, settings: AgentSettings | None = None) -> None:
    """The service: the rings of ``job`` (default: every job under the shm dir) until ``stop``.

    The caller owns ``ctx`` (its connection is drained when the caller closes it). Connected
    as a bus user, that user must be this agent's (agent-<id>): the server lets it publish and
    serve only its own agent id's subjects, so any other would fail on every message."""
    agent_id = agent_id or default_agent_id()
    creds = ctx.backends.nats_credentials
    if creds is not None and agent_of_user(creds.user) != agent_id:
        raise BusAuthError(f"agent {agent_id} is connected as bus user {creds.user!r}, which may "
                           f"act only for {agent_of_user(creds.user) or 'a service'}; set "
                           f"GREYHOUND_NATS_USER={agent_user(agent_id)} and its password, or "
                           "--agent-id to the id the user is bound to")
    agent = NodeAgent(ctx.settings.shm_dir, ctx.js, agent_id=agent_id, jobs=job or None,
                      settings=settings or AgentSettings())
    control = AgentControl(agent.agent_id, agent.collectors,
                           gpu=agent.gpu.samples if agent.gpu is not None else None)
    log.info("agent %s watching %s", agent.agent_id, ctx.settings.shm_dir)
    try:
        await agent.run(stop, nc=ctx.nc, control=control)
    finally:
        await control.close()
