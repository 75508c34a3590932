"""The analyzer's localisation on a real nats-server and Postgres, with stand-in agents that
answer set_mode and, in profile mode, publish the collectives of a 4-rank job: timed on the GPU
(hosts enqueue together, the late rank's GPU arrives late) or, for a host-only job, on host
time."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Collection
from typing import Any

import nats.errors
import numpy as np
from nats.aio.msg import Msg

from services.analyzer.service import Analyzer
from services.common.bus.client import BusClient, publish
from services.common.bus.contract import (
    CollectiveBatch,
    ControlReply,
    ControlRequest,
    DetectionEvent,
    GpuSample,
    Subjects,
    Suspicion,
)
from services.common.bus.streams import EVENTS
from services.common.db import repository as repo
from services.common.runtime import ServiceContext
from tests.services.analyzer.helpers import AGENTS, fed_localizer, register_ranks

COMM = (1 << 64) - 12345  # an unsigned hash above 2^63: must survive the int64 cores


def collectives(job: str, agent: str, ranks: list[int], *, iters: int, iter_ms: float,
                late_rank: int | None, late_ms: float, seed: int,
                comm_ms: float = 0.5, gpu: bool = False,
                marks_off: Collection[int] = ()) -> CollectiveBatch:
    """One all-reduce per iteration on one 4-rank communicator; the late rank arrives late and
    everyone completes together, as NCCL ranks do. With ``gpu``, arrival and completion are GPU
    times and every host enqueues the call at the same instant (NCCL is asynchronous); without,
    a host-only job whose host enter/exit are the arrival and completion. A rank of
    ``marks_off`` has no GPU times even in a GPU job (its hook found no CUDA API to time with)."""
    rng = np.random.default_rng(seed)
    cols: dict[str, list[int]] = {k: [] for k in (
        "rank", "comm_id", "comm_rank", "nranks", "seq", "op", "count", "dtype", "peer",
        "enter_ns", "exit_ns", "gpu_start_ns", "gpu_end_ns")}
    t0 = 1_700_000_000_000_000_000
    for it in range(iters):
        start = t0 + int(it * iter_ms * 1e6)
        compute = {r: 30e6 + rng.normal(0, 0.2e6) + (late_ms * 1e6 if r == late_rank else 0)
                   for r in range(4)}
        exit_ns = start + int(max(compute.values()) + comm_ms * 1e6)
        for r in ranks:
            arrive = start + int(compute[r])
            timed = gpu and r not in marks_off
            host = (start + 1000, start + 21_000) if timed else (arrive, exit_ns)
            for key, value in (("rank", r), ("comm_id", COMM), ("comm_rank", r), ("nranks", 4),
                               ("seq", it + 1), ("op", 1), ("count", 1 << 18), ("dtype", 7),
                               ("peer", -1), ("enter_ns", host[0]), ("exit_ns", host[1]),
                               ("gpu_start_ns", arrive if timed else 0),
                               ("gpu_end_ns", exit_ns if timed else 0)):
                cols[key].append(value)
    return CollectiveBatch(job_id=job, agent_id=agent, **cols)


class StandInAgents:
    """Answers control requests for each agent; publishes a profile window when asked."""

    def __init__(self, agents: dict[str, BusClient], job: str, **profile: Any) -> None:
        self.agents, self.job, self.profile = agents, job, profile
        self.modes: list[str] = []

    async def start(self) -> None:
        for i, agent in enumerate(AGENTS):
            async def answer(msg: Msg, agent: str = agent, i: int = i) -> None:
                req = ControlRequest.model_validate_json(msg.data)
                if req.action == "gpu":  # GPU health: rank 2's GPU runs hot
                    gpus = [GpuSample(index=r % 2, host=f"host{i}", ranks=[r],
                                      sm_clock_mhz=1095 if r == 2 else 1980,
                                      throttle=["hw_thermal"] if r == 2 else [],
                                      temperature_c=87 if r == 2 else 60)
                            for r in (2 * i, 2 * i + 1)]
                    await msg.respond(ControlReply(ok=True, agent_id=agent, gpus=gpus)
                                      .model_dump_json().encode())
                    return
                self.modes.append(str(req.mode))
                await msg.respond(ControlReply(ok=True, agent_id=agent).model_dump_json().encode())
                if req.mode == "profile":
                    batch = collectives(self.job, agent, [2 * i, 2 * i + 1], seed=i, **self.profile)
                    await publish(self.agents[agent].jetstream(),
                                  Subjects.collectives(self.job, agent), batch)
            await self.agents[agent].subscribe(Subjects.control(self.job, agent), cb=answer)
            await self.agents[agent].flush()  # subscribed before the analyzer asks


async def run_case(ctx: ServiceContext, agents_nc: dict[str, BusClient], operator: BusClient,
                   *, before_s: float, after_s: float,
                   **profile: Any) -> tuple[dict[str, Any], list[Suspicion], list[str]]:
    job = f"loc{uuid.uuid4().hex[:8]}"
    await register_ranks(ctx, job, profile.get("marks_off", ()))
    agents = StandInAgents(agents_nc, job, **profile)
    await agents.start()
    localizer, feed, feeding = fed_localizer(ctx, job)
    det = DetectionEvent(job_id=job, kind="slowdown", ranks=[0, 1, 2, 3], first_iteration=100,
                         detected_iteration=104, before_s=before_s, after_s=after_s,
                         detected_ns=0)
    await Analyzer(ctx, localizer.work, localizer).consume(Subjects.detection(job), det)
    for _ in range(200):
        if not localizer.tasks:
            break
        await asyncio.sleep(0.05)
    feed.stop()
    await feeding
    async with ctx.db()() as session:
        rows = await repo.list_incidents(session, job_id=job)
        assert len(rows) == 1
        inc = rows[0]
        incident = {"kind": inc.kind, "status": inc.status, "culprit": inc.culprit.as_json(),
                    "evidence": inc.evidence.as_json(),
                    "timeline": [(e.stage, e.detail.as_json()) for e in inc.timeline]}
    suspicions = await operator.jetstream().pull_subscribe(Subjects.suspicion(job), durable=None,
                                                          stream=EVENTS)
    try:
        msgs = await suspicions.fetch(5, timeout=1.0)
    except (nats.errors.TimeoutError, TimeoutError):  # no suspicion (fetch's own, or asyncio's)
        msgs = []
    await suspicions.unsubscribe()
    return incident, [Suspicion.model_validate_json(m.data) for m in msgs], agents.modes


async def test_late_gpu_is_localized_while_every_host_enters_together(
        ctx: ServiceContext, agents: dict[str, BusClient], operator: BusClient) -> None:
    incident, suspicions, modes = await run_case(
        ctx, agents, operator,
        before_s=0.031, after_s=0.051, iters=40, iter_ms=55.0, late_rank=2, late_ms=20.0,
        gpu=True)
    assert modes == ["profile", "profile", "monitor", "monitor"]
    assert incident["kind"] == "compute_slow", incident["evidence"]
    assert incident["culprit"]["compute_ranks"] == [2]
    assert incident["evidence"]["localization"]["timing"] == {
        "basis": "gpu", "gpu_rows": 160, "host_only_rows": 0, "excluded_rows": 0}
    assert suspicions[0].ranks == [2] and suspicions[0].evidence["timing"]["basis"] == "gpu"
    # the GPU's own health says why, in the evidence and in words
    words = ("GPU 0 on host1 (rank 2) is thermally throttled (SM clock 1095 MHz vs 1980 MHz on "
             "its peers; 87 C)")
    assert incident["evidence"]["explanation"] == words
    assert incident["evidence"]["gpu_health"]["gpus_sampled"] == 4
    assert incident["evidence"]["gpu_health"]["samples"][0]["ranks"] == [2]


async def test_a_rank_without_completion_marks_is_named_in_the_slowdown(
        ctx: ServiceContext, agents: dict[str, BusClient], operator: BusClient) -> None:
    """Rank 3's hook found neither a CUDA runtime nor the driver API (its agent's hello says
    so): its calls have host times only, on which the profile of a GPU job rests for it. The
    incident and the suspicion name it, as a hang's incident names such ranks."""
    incident, suspicions, _ = await run_case(
        ctx, agents, operator,
        before_s=0.031, after_s=0.051, iters=40, iter_ms=55.0, late_rank=2, late_ms=20.0,
        gpu=True, marks_off=[3])
    assert incident["culprit"]["compute_ranks"] == [2], incident["evidence"]
    localization = incident["evidence"]["localization"]
    assert localization["marks_off_ranks"] == [3]
    assert localization["timing"]["host_only_rows"] == 40  # rank 3's, one a step
    assert suspicions[0].evidence["marks_off_ranks"] == [3]


async def test_late_rank_is_localized_as_compute(
        ctx: ServiceContext, agents: dict[str, BusClient], operator: BusClient) -> None:
    incident, suspicions, modes = await run_case(
        ctx, agents, operator,
        before_s=0.031, after_s=0.051, iters=40, iter_ms=55.0, late_rank=2, late_ms=20.0)
    assert modes == ["profile", "profile", "monitor", "monitor"]
    assert incident["evidence"]["localization"]["timing"]["basis"] == "host"
    assert incident["kind"] == "compute_slow"
    assert incident["culprit"]["compute_ranks"] == [2]
    assert incident["culprit"]["nodes"] == ["host1"]
    stages = [s for s, _ in incident["timeline"]]
    assert stages == ["detected", "localized"]
    compute = incident["evidence"]["localization"]["compute"]
    assert compute[0]["rank"] == 2 and compute[0]["p"] > 0.9
    assert len(suspicions) == 1
    assert suspicions[0].kind == "compute_slow" and suspicions[0].ranks == [2]


async def test_ended_slowdown_is_transient(
        ctx: ServiceContext, agents: dict[str, BusClient], operator: BusClient) -> None:
    incident, suspicions, _ = await run_case(
        ctx, agents, operator,
        before_s=0.031, after_s=0.051, iters=40, iter_ms=31.0, late_rank=None, late_ms=0.0)
    assert incident["kind"] == "slowdown"
    assert incident["status"] == "resolved"
    assert incident["timeline"][-1][1]["result"] == "transient"
    assert suspicions == []


async def test_slow_single_communicator_is_named_by_elimination(
        ctx: ServiceContext, agents: dict[str, BusClient], operator: BusClient) -> None:
    # Nobody is late, the job is still slow, and the one communicator spends 25 ms an
    # iteration inside: more than the 20 ms the iteration gained.
    incident, suspicions, _ = await run_case(
        ctx, agents, operator,
        before_s=0.035, after_s=0.055, iters=40, iter_ms=55.0, late_rank=None,
        late_ms=0.0, comm_ms=25.0)
    assert incident["kind"] == "comm_slow"
    assert incident["culprit"]["comm_ids"] == [COMM]
    assert incident["culprit"]["ranks"] == [0, 1, 2, 3]
    assert suspicions[0].comm_ids == [COMM]
