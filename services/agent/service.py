"""The node agent: drains every rank's ring on this host and publishes to the bus.

It never touches the training processes beyond reading their rings (and, later, writing their
control blocks), so a dead bus costs telemetry, never the job: publishing failures are logged and
the batch is retried on the next tick, bounded so memory cannot grow without limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import time
from collections import deque
from pathlib import Path

from nats.aio.client import Client as NATS
from nats.errors import MaxPayloadError
from nats.js import JetStreamContext

from greyhound.ids import check_token, slug
from services.agent.collector import Collector, RankIteration
from services.agent.control import AgentControl
from services.agent.nvml import GpuMonitor, NvmlSampler
from services.agent.settings import AgentSettings
from services.common.bus.client import publish
from services.common.bus.contract import (
    AgentHello,
    CollectiveBatch,
    CounterBatch,
    IterationBatch,
    Message,
    RankInfo,
    Subjects,
    split_columns,
)
from services.common.runtime import ServiceContext

log = logging.getLogger(__name__)

MAX_BACKLOG = 10_000  # unpublished messages kept while the bus is unreachable
# Rows per CollectiveBatch: ~0.5 MB of JSON, under NATS's default 1 MB max_payload. A server with
# a smaller limit still gets everything: flush() halves a batch the server refuses as too large.
COLLECTIVE_ROWS = 4_000
_NODE = re.compile(r"node(\d+)$")


def node_of(host: str) -> int | None:
    """The node index in host names like ``sim-node3`` or ``node12``; None for other names."""
    m = _NODE.search(host.split(".")[0])
    return int(m.group(1)) if m else None


def default_agent_id() -> str:
    return slug(socket.gethostname().split(".")[0], 100) or "agent"


class NodeAgent:
    def __init__(self, shm_dir: Path, js: JetStreamContext, *, agent_id: str,
                 jobs: list[str] | None = None, settings: AgentSettings | None = None) -> None:
        self.shm_dir = Path(shm_dir)
        self.settings = settings or AgentSettings()
        self.js = js
        self.agent_id = check_token(agent_id, "agent id")
        self.fixed_jobs = jobs
        self.collectors: dict[str, Collector] = {}
        self.backlog: deque[tuple[str, Message]] = deque(maxlen=MAX_BACKLOG)
        self.published = 0
        self.dropped = 0  # messages no server could take (a single row over max_payload)
        self.gpu: GpuMonitor | None = None
        if self.settings.nvml:
            self.gpu = GpuMonitor(NvmlSampler(self.settings.nvml_lib, host=socket.gethostname()),
                                  agent_id=self.agent_id, sample_s=self.settings.gpu_s,
                                  xid_poll_s=self.settings.xid_poll_s)

    def _job_dirs(self) -> list[str]:
        if self.fixed_jobs is not None:
            return self.fixed_jobs
        root = self.shm_dir
        if not root.is_dir():
            return []
        return sorted(p.name for p in root.iterdir() if p.is_dir())

    def scan(self) -> None:
        for job in self._job_dirs():
            try:
                check_token(job, "job id")
            except ValueError:
                log.warning("ignoring ring directory %r: not a valid job id", job)
                continue
            col = self.collectors.setdefault(job, Collector(self.shm_dir, job))
            new = col.scan()
            if new:
                ranks = [RankInfo(rank=s.rank, host=s.reader.header.host, pid=s.reader.header.pid,
                                  device=s.reader.header.device,
                                  node=node_of(s.reader.header.host)) for s in new]
                hello = AgentHello(job_id=job, agent_id=self.agent_id,
                                   host=socket.gethostname(), ranks=ranks)
                self.backlog.append((Subjects.hello(job, self.agent_id), hello))

    def collect_iterations(self) -> None:
        for job, col in self.collectors.items():
            its: list[RankIteration] = col.drain()
            self.collect_profiled(job, col)
            if not its:
                continue
            batch = IterationBatch(
                job_id=job, agent_id=self.agent_id, rank=[i.rank for i in its],
                iteration=[i.iteration for i in its], end_ns=[i.end_wall_ns for i in its],
                duration_s=[i.duration_s for i in its])
            self.backlog.append((Subjects.iterations(job, self.agent_id), batch))

    def collect_profiled(self, job: str, col: Collector) -> None:
        """Every collective of ranks in profile mode (switched through control), wall clock."""
        rows = col.take_profiled()
        for part in rows.chunks(COLLECTIVE_ROWS):
            batch = CollectiveBatch(job_id=job, agent_id=self.agent_id, **vars(part))
            self.backlog.append((Subjects.collectives(job, self.agent_id), batch))

    def collect_counters(self) -> None:
        now_mono = time.monotonic_ns()
        for job, col in self.collectors.items():
            rows = col.counters(now_mono)
            if not rows.rank:
                continue
            batch = CounterBatch(job_id=job, agent_id=self.agent_id, sampled_ns=time.time_ns(),
                                 **vars(rows))
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
                log.warning("publish to %s failed (%s); %d messages waiting", subject, exc,
                            len(self.backlog))
                return
            self.backlog.popleft()
            self.published += 1

    async def run(self, stop: asyncio.Event, *, nc: NATS | None = None,
                  control: AgentControl | None = None) -> None:
        """Drain and publish until ``stop``; with ``control`` (and its connection ``nc``), also
        answer control requests for every job found."""
        next_scan = next_counters = 0.0
        gpu_task = None
        if self.gpu is not None:
            gpu_task = asyncio.create_task(self.gpu.run(
                stop, self.collectors, lambda subject, msg: self.backlog.append((subject, msg))))
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_scan:
                self.scan()
                if control is not None and nc is not None:
                    await control.subscribe_new_jobs(nc)
                next_scan = now + 1.0
            self.collect_iterations()
            if now >= next_counters:
                self.collect_counters()
                next_counters = now + self.settings.counters_s
            await self.flush()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.settings.poll_s)
        self.collect_iterations()
        if gpu_task is not None:
            await gpu_task
        await self.flush()
        for col in self.collectors.values():
            col.close()


async def run_agent(ctx: ServiceContext, stop: asyncio.Event, *, job: list[str] | None = None,
                    agent_id: str | None = None, settings: AgentSettings | None = None) -> None:
    """The service: the rings of ``job`` (default: every job under the shm dir) until ``stop``.

    The caller owns ``ctx`` (its connection is drained when the caller closes it)."""
    agent = NodeAgent(ctx.settings.shm_dir, ctx.js, agent_id=agent_id or default_agent_id(),
                      jobs=job or None, settings=settings)
    control = AgentControl(agent.agent_id, agent.collectors,
                           gpu=agent.gpu.samples if agent.gpu is not None else None)
    log.info("agent %s watching %s", agent.agent_id, ctx.settings.shm_dir)
    try:
        await agent.run(stop, nc=ctx.nc, control=control)
    finally:
        await control.close()
