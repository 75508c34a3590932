"""The validator on GPU-timed benchmarks, against a stand-in agent over a real nats-server: each
paused rank first drains its queued GPU work (drain_ns, recorded per rank in the evidence), and
the end of a transfer that started first waits for its peer inside its timed kernel, which only
the first repeat shows and which must not make a healthy link look slow."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError

from services.common.bus.auth import agent_user
from services.common.bus.client import BusClient
from services.common.bus.contract import (
    BenchItem,
    BenchOutcome,
    CommStatus,
    ControlReply,
    ControlRequest,
    RankStatus,
    Subjects,
    Suspicion,
)
from services.common.db.models import Rank
from services.common.runtime import ServiceContext, start_service
from services.common.settings import Settings
from services.validator.hold import Hold
from services.validator.settings import ValidatorSettings
from tests.conftest import Bus

JOB, AGENT, WORLD, COMM = "gpubench", "gpu-agent", 4, 0xABC
MS = 1_000_000
DRAIN_NS = {0: 3 * MS, 1: 40 * MS, 2: 7 * MS, 3: 120 * MS}  # the first benchmark of each rank


class StandInAgent:
    """Four ranks on one node: rank 2's GEMM is 2x slower, the link 1->2 4x slower; a receive
    at rank 3 starts 50 ms before its sender (a longer drain elsewhere) in its first repeat."""

    def __init__(self) -> None:
        self.paused = False
        self.drained: set[int] = set()
        self.benched: list[BenchItem] = []

    job_timeout_s: float | None = None  # what the ranks report of the job's collective timeout

    def _status(self) -> list[RankStatus]:
        return [RankStatus(rank=r, host="node0", device=r, mode="monitor", paused=self.paused,
                           comms=[CommStatus(comm_id=COMM, comm_rank=r, nranks=WORLD,
                                             last_seq_entered=100, last_seq_completed=100)],
                           job_timeout_s=self.job_timeout_s)
                for r in range(WORLD)]

    def _run(self, it: BenchItem) -> BenchOutcome:
        drain = 0 if it.rank in self.drained else DRAIN_NS[it.rank]
        self.drained.add(it.rank)
        self.benched.append(it)
        if it.kind == "gemm":
            times = [(2 if it.rank == 2 else 1) * 10 * MS] * it.repeat
        else:
            src, dst = (it.rank, it.peer) if it.kind == "send" else (it.peer, it.rank)
            base = it.size // 10_000 * (4 if (src, dst) == (1, 2) else 1)  # 10 GB/s
            times = [base] * it.repeat
            if it.kind == "recv" and it.rank == 3:
                times[0] += 50 * MS
        return BenchOutcome(item=it, state="done", durations_ns=times, drain_ns=drain)

    async def answer(self, msg: Msg) -> None:
        req = ControlRequest.model_validate_json(msg.data)
        reply: dict[str, Any] = {"ok": True, "agent_id": AGENT}
        if req.action == "pause":
            self.paused = True
        elif req.action == "resume":
            self.paused = False
        elif req.action == "bench":
            reply["results"] = [self._run(it) for it in req.bench]
        reply["ranks"] = self._status()
        await msg.respond(ControlReply(**reply).model_dump_json().encode())


async def serving(agent_nc: BusClient, validator_nc: BusClient, agent: StandInAgent
                  ) -> list[Subscription]:
    """The stand-in agent answering: status on the control subject; pause, bench and resume on
    the validation subject. Returns once the validator's own connection gets an answer (a
    flush on the agent's connection alone left a status request, now and then, with no
    responders yet: the test then failed as an agent that never answered)."""
    subs = [await agent_nc.subscribe(subject, cb=agent.answer)
            for subject in (Subjects.control(JOB, AGENT), Subjects.validation(JOB, AGENT))]
    await agent_nc.flush()
    probe = ControlRequest(job_id=JOB, action="status").model_dump_json().encode()
    deadline = time.monotonic() + 30.0
    while True:
        try:
            await validator_nc.request(Subjects.control(JOB, AGENT), probe, timeout=2.0)
            return subs
        except (NoRespondersError, TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


@pytest.fixture()
async def ctx(bus: Bus) -> AsyncIterator[ServiceContext]:
    """The validator's connection; the stand-in agent answers on its own (``agent_nc``)."""
    c = await start_service("validator", Settings(nats_url=bus.url), need_db=False,
                            backends=bus.backends("validator"))
    yield c
    await c.close()


@pytest.fixture()
async def agent_nc(bus: Bus) -> AsyncIterator[BusClient]:
    nc = await bus.connect(agent_user(AGENT))
    yield nc
    await nc.close()


async def test_drain_is_recorded_per_rank_and_a_late_peer_is_not_a_slow_link(
        ctx: ServiceContext, agent_nc: BusClient) -> None:
    agent = StandInAgent()
    subs = await serving(agent_nc, ctx.nc, agent)
    ranks = [Rank(job_id=JOB, rank=r, host="node0", node=0, device=r, pid=10 + r,
                  agent_id=AGENT) for r in range(WORLD)]
    s = Suspicion(job_id=JOB, incident_id="i", kind="mixed_slow", ranks=[2], comm_ids=[COMM])
    try:
        run = await Hold(ctx.nc, ValidatorSettings(poll_s=0.01)).validate(s, ranks)
    finally:
        for sub in subs:
            await sub.unsubscribe()
    assert run.verdict is not None, run.failure
    assert not agent.paused  # resumed
    assert {it.kind for it in agent.benched} == {"gemm", "drain", "split", "send", "recv"}
    # every rank drains, then splits the checked communicator, before any transfer is issued
    kinds = [it.kind for it in agent.benched]
    first_transfer = min(kinds.index("send"), kinds.index("recv"))
    assert kinds[:first_transfer].count("split") == WORLD
    assert kinds.index("drain") < kinds.index("split") < first_transfer
    assert run.evidence["drain_s"] == {str(r): d / 1e9 for r, d in DRAIN_NS.items()}
    assert run.verdict.gpus == [2]
    assert run.verdict.links == [(1, 2)], run.evidence  # not the links into rank 3
    assert all(len(v) == 3 for v in run.evidence["p2p_s"].values())  # one time per size
