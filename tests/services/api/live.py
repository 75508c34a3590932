"""A slowdown produced through the real services: agent-format telemetry published on NATS, the
tracker's BOCD+V detecting it, the analyzer opening the incident, and the API serving it."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import uvicorn
from nats.js import JetStreamContext

from services.analyzer.service import Analyzer
from services.api.app import create_app
from services.api.settings import ApiSettings
from services.common.bus.client import Consumer, publish
from services.common.bus.contract import (
    AgentHello,
    CollectiveBatch,
    DetectionEvent,
    IterationBatch,
    RankInfo,
    Subjects,
)
from services.common.bus.streams import ANALYZER
from services.common.runtime import ServiceContext, start_service
from services.common.settings import Settings
from services.tracker.service import run_tracker
from tests.conftest import Bus

RANKS = 4
SLOW_RANK = 2
HEALTHY, SLOW = 0.25, 0.375
AGENT = "node-a"


@dataclass
class LiveJob:
    job_id: str
    healthy_iters: int = 160


def _iterations(job: LiveJob, first: int, ends: list[int], durations: list[float]
                ) -> IterationBatch:
    n = len(ends)
    return IterationBatch(
        job_id=job.job_id, agent_id=AGENT, rank=[r for _ in range(n) for r in range(RANKS)],
        iteration=[first + i for i in range(n) for _ in range(RANKS)],
        end_ns=[e for e in ends for _ in range(RANKS)],
        duration_s=[d for d in durations for _ in range(RANKS)])


def _collectives(job: LiveJob, seq: int, end_ns: int, rng: random.Random) -> CollectiveBatch:
    """One profiled all-reduce of the iteration: rank 2 arrives 90 ms after its peers."""
    rows: dict[str, list[int]] = {c: [] for c in CollectiveBatch.COLUMNS}
    arrive = end_ns - int(0.15e9)
    for r in range(RANKS):
        late = int(0.09e9) if r == SLOW_RANK else int(rng.uniform(0, 0.004e9))
        for col, v in (("rank", r), ("comm_id", 77), ("comm_rank", r), ("nranks", RANKS),
                       ("seq", seq), ("op", 0), ("count", 1 << 20), ("dtype", 7), ("peer", -1),
                       ("enter_ns", arrive - int(0.1e9) + late), ("exit_ns", arrive),
                       ("gpu_start_ns", 0), ("gpu_end_ns", 0)):
            rows[col].append(v)
    return CollectiveBatch(job_id=job.job_id, agent_id=AGENT, **rows)


async def publish_history(agent: JetStreamContext, job: LiveJob, seed: int = 3) -> int:
    """What the node agent (``agent``: its connection) published for a healthy 4-rank job until
    now: its hello and ``healthy_iters`` iterations of 0.25 s ending now. Returns the next
    iteration number."""
    rng = random.Random(seed)
    await publish(agent, Subjects.hello(job.job_id, AGENT), AgentHello(
        job_id=job.job_id, agent_id=AGENT, host="node-a", world_size=RANKS,
        ranks=[RankInfo(rank=r, host="node-a", pid=1000 + r, device=r, node=0)
               for r in range(RANKS)]))
    durations = [HEALTHY * (1 + 0.01 * rng.gauss(0, 1)) for _ in range(job.healthy_iters)]
    end = time.time_ns() - int(sum(durations) * 1e9)
    ends = []
    for d in durations:
        end += int(d * 1e9)
        ends.append(end)
    for start in range(0, job.healthy_iters, 10):
        await publish(agent, Subjects.iterations(job.job_id, AGENT),
                      _iterations(job, start, ends[start:start + 10], durations[start:start + 10]))
    return job.healthy_iters


async def run_slow(agent: JetStreamContext, job: LiveJob, first: int, stop: asyncio.Event,
                   seed: int = 5) -> None:
    """From now on rank 2 is 1.5x slower: one iteration per 0.375 s of wall time, as the agent
    would publish it live, with the profiled collectives the analyzer asks for."""
    rng = random.Random(seed)
    i = first
    while not stop.is_set():
        d = SLOW * (1 + 0.01 * rng.gauss(0, 1))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), d)
        now = time.time_ns()
        await publish(agent, Subjects.iterations(job.job_id, AGENT),
                      _iterations(job, i, [now], [d]))
        await publish(agent, Subjects.collectives(job.job_id, AGENT),
                      _collectives(job, i, now, rng))
        i += 1


@contextlib.asynccontextmanager
async def detecting_services(bus: Bus, settings: Settings) -> AsyncIterator[Analyzer]:
    """The tracker and the analyzer, each as its own bus user (incidents without profiling: no
    agent is there to switch into profile mode, and the test is about what the API shows, not
    about localisation)."""
    stop = asyncio.Event()
    db = settings.database_url or ""
    tracker = await start_service("tracker", settings, backends=bus.backends("tracker", db))
    ctx = await start_service("analyzer", settings, backends=bus.backends("analyzer", db))
    analyzer = Analyzer(ctx, ctx.work("analyzer"))
    consumer: Consumer[DetectionEvent] = Consumer(ctx.js, ANALYZER, DetectionEvent, analyzer.consume)
    tasks = [asyncio.create_task(run_tracker(tracker, stop)), asyncio.create_task(consumer.run())]
    try:
        yield analyzer
    finally:
        stop.set()
        consumer.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in (ctx, tracker):
            await c.close()


@contextlib.asynccontextmanager
async def serve_api(ctx: ServiceContext, port: int) -> AsyncIterator[str]:
    app = create_app(ctx.db(), settings=ctx.settings, api=ApiSettings(), nc=ctx.nc,
                     js=ctx.js)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    server.capture_signals = contextlib.nullcontext
    task = asyncio.create_task(server.serve())
    for _ in range(300):
        if server.started:
            break
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
