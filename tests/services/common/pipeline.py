"""The services in one process on their own nats-server and a fresh database, fed by stand-in
agents: a 4-rank job on two nodes whose iteration times the test publishes, and which answers
control as the hook would (profile windows in which rank 2 arrives late, a pause, GEMMs in which
rank 2 is twice as slow). Counts every control action, so a test can prove that a job was
profiled and paused exactly once."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from services.analyzer.service import run_analyzer
from services.common.bus.auth import agent_user
from services.common.bus.client import BusClient, publish
from services.common.bus.contract import (
    AgentHello,
    BenchOutcome,
    CollectiveBatch,
    CommStatus,
    ControlReply,
    ControlRequest,
    DetectionEvent,
    IncidentEvent,
    IterationBatch,
    Message,
    RankInfo,
    RankStatus,
    Subjects,
    Suspicion,
)
from services.common.bus.streams import EVENTS
from services.common.db import repository as repo
from services.common.db.models import Incident
from services.common.embedded import OPERATOR
from services.common.runtime import ServiceContext, start_service
from services.common.settings import Settings
from services.tracker.service import run_tracker
from services.validator.service import run_validator
from tests.conftest import TEST_TOKEN_KEY, Bus

AGENTS = {"node-a": (0, 1), "node-b": (2, 3)}
WORLD = 4
COMM = (1 << 64) - 4242
SLOW_RANK = 2


def collectives(job: str, agent: str, ranks: Sequence[int], seed: int) -> CollectiveBatch:
    """40 iterations of one all-reduce; the slow rank enters 25 ms late, all leave together."""
    rng = np.random.default_rng(seed)
    cols: dict[str, list[int]] = {k: [] for k in CollectiveBatch.COLUMNS}
    t0 = time.time_ns() - 5_000_000_000
    for it in range(40):
        start = t0 + it * 80_000_000
        compute = {r: 30e6 + rng.normal(0, 0.2e6) + (25e6 if r == SLOW_RANK else 0.0)
                   for r in range(WORLD)}
        exit_ns = start + int(max(compute.values()) + 0.5e6)
        for r in ranks:
            row = {"rank": r, "comm_id": COMM, "comm_rank": r, "nranks": WORLD, "seq": it + 1,
                   "op": 1, "count": 1 << 18, "dtype": 7, "peer": -1,
                   "enter_ns": start + int(compute[r]), "exit_ns": exit_ns,
                   "gpu_start_ns": 0, "gpu_end_ns": 0}
            for key, value in row.items():
                cols[key].append(value)
    return CollectiveBatch(job_id=job, agent_id=agent, **cols)


@dataclass
class StandInJob:
    """The job's two agents, each on the bus as its own agent user: telemetry on request,
    control answered as the hook would."""

    bus: Bus
    job: str
    actions: Counter[str] = field(default_factory=Counter)
    paused: bool = False
    _nc: dict[str, BusClient] = field(default_factory=dict)
    _sent: int = 0

    def _js(self, agent: str) -> JetStreamContext:
        return self._nc[agent].jetstream()

    async def start(self) -> None:
        for agent in AGENTS:
            nc = self._nc[agent] = await self.bus.connect(agent_user(agent), name=f"stand-in-{agent}")

            async def answer(msg: Msg, agent: str = agent) -> None:
                await self._answer(msg, agent)
            for subject in (Subjects.control(self.job, agent), Subjects.validation(self.job, agent)):
                await nc.subscribe(subject, cb=answer)
            await nc.flush()  # subscribed before anyone asks, on another connection
            ranks = [RankInfo(rank=r, host=agent, pid=100 + r, device=r % 2)
                     for r in AGENTS[agent]]
            await publish(self._js(agent), Subjects.hello(self.job, agent),
                          AgentHello(job_id=self.job, agent_id=agent, host=agent, ranks=ranks,
                                     world_size=WORLD))

    async def close(self) -> None:
        for nc in self._nc.values():
            with contextlib.suppress(Exception):
                await nc.close()
        self._nc.clear()

    async def _answer(self, msg: Msg, agent: str) -> None:
        req = ControlRequest.model_validate_json(msg.data)
        self.actions[f"{req.action}:{req.mode}" if req.action == "set_mode" else req.action] += 1
        mine = [r for r in AGENTS[agent] if req.ranks is None or r in req.ranks]
        reply = ControlReply(ok=True, agent_id=agent)
        if req.action == "pause":
            self.paused = True
        elif req.action == "resume":
            self.paused = False
        elif req.action == "status":
            reply = ControlReply(ok=True, agent_id=agent, ranks=[
                RankStatus(rank=r, host=agent, device=r % 2, mode="monitor", paused=self.paused,
                           comms=[CommStatus(comm_id=COMM, comm_rank=r, nranks=WORLD,
                                             last_seq_entered=500, last_seq_completed=500)])
                for r in mine])
        elif req.action == "bench":
            reply = ControlReply(ok=True, agent_id=agent, results=[
                BenchOutcome(item=it, state="done", durations_ns=[
                    (20_000_000 if it.rank == SLOW_RANK else 10_000_000)] * it.repeat)
                for it in req.bench])
        await msg.respond(reply.model_dump_json().encode())
        if req.action == "set_mode" and req.mode == "profile":
            await publish(self._js(agent), Subjects.collectives(self.job, agent),
                          collectives(self.job, agent, AGENTS[agent], seed=self.actions.total()))

    async def iterations(self, start: int, stop: int, *, slow: tuple[int, int] = (0, 0),
                         factor: float = 1.5, seed: int = 0) -> None:
        """Iterations [start, stop) of every rank, two per message per agent; slower by
        ``factor`` inside ``slow`` (a synchronous job: every rank waits for the slow one)."""
        rng = np.random.default_rng(seed + start)
        for it in range(start, stop, 2):
            its = list(range(it, min(it + 2, stop)))
            for agent, ranks in AGENTS.items():
                rank = [r for r in ranks for _ in its]
                iteration = [i for _ in ranks for i in its]
                dur = [0.1 * (1 + 0.01 * float(rng.standard_normal()))
                       * (factor if slow[0] <= i < slow[1] else 1.0) for i in iteration]
                await publish(self._js(agent), Subjects.iterations(self.job, agent), IterationBatch(
                    job_id=self.job, agent_id=agent, rank=rank, iteration=iteration,
                    end_ns=[1_000_000_000 + i * 100_000_000 for i in iteration], duration_s=dur))
                self._sent += 1


@dataclass
class Pipeline:
    settings: Settings
    bus: Bus
    ctx: ServiceContext  # the test's own connection, as operator: it looks at what happened
    services: dict[str, ServiceContext]
    stop: asyncio.Event
    tasks: dict[str, asyncio.Task[None]]

    def alive(self) -> None:
        dead = {n: t for n, t in self.tasks.items() if t.done()}
        assert not dead, {n: (t.exception() if not t.cancelled() else "cancelled")
                          for n, t in dead.items()}

    async def incidents(self, job: str) -> list[Incident]:
        async with self.ctx.db()() as session:
            return list(await repo.list_incidents(session, job_id=job))

    async def wait(self, what: str, pred: Any, timeout_s: float = 60.0) -> Any:
        """Poll ``pred`` (async, returning a truthy value when done) with a generous bound."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.alive()
            got = await pred()
            if got:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
            await asyncio.sleep(0.1)

    async def stage(self, job: str, status: str, timeout_s: float = 60.0) -> Incident:
        async def reached() -> Incident | None:
            rows = await self.incidents(job)
            return next((i for i in rows if i.status == status), None)
        inc: Incident = await self.wait(f"an incident of {job} {status}", reached, timeout_s)
        return inc

    async def events(self, job: str) -> dict[str, list[Any]]:
        """Every detection, incident event and suspicion of the job stored in the events stream."""
        out: dict[str, list[Any]] = {"detect": [], "incident": [], "suspect": []}
        models: dict[str, type[Message]] = {"detect": DetectionEvent, "incident": IncidentEvent,
                                            "suspect": Suspicion}
        sub = await self.ctx.js.pull_subscribe(
            f"{Subjects.detection(job).rsplit('.', 1)[0]}.*", durable=None, stream=EVENTS,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE))
        try:
            while True:
                try:
                    msgs = await sub.fetch(256, timeout=0.5)
                except TimeoutError:
                    break
                for m in msgs:
                    kind = m.subject.rsplit(".", 1)[1]
                    out[kind].append(models[kind].model_validate_json(m.data))
        finally:
            await sub.unsubscribe()
        return out


@contextlib.asynccontextmanager
async def pipeline(bus: Bus, db_url: str, data_dir: Any,
                   services: Sequence[str] = ("tracker", "analyzer", "validator"),
                   **settings: Any) -> AsyncIterator[Pipeline]:
    """The services as tasks of this process, each with its own connections and bus user (as
    processes)."""
    s = Settings(nats_url=bus.url, database_url=db_url, data_dir=data_dir,
                 outbox_poll_s=0.2, outbox_grace_s=0.3,
                 **{"token_key": TEST_TOKEN_KEY, **settings})  # an API made on it needs one
    ctx = await start_service("pipeline-test", s, backends=bus.backends(OPERATOR, db_url))
    stop = asyncio.Event()
    runners = {"tracker": run_tracker, "analyzer": run_analyzer, "validator": run_validator}
    ctxs = {n: await start_service(n, s, backends=bus.backends(n, db_url)) for n in services}
    tasks = {n: asyncio.create_task(runners[n](ctxs[n], stop), name=n) for n in services}
    try:
        yield Pipeline(s, bus, ctx, ctxs, stop, tasks)
    finally:
        stop.set()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        for c in [*ctxs.values(), ctx]:
            await c.close()
