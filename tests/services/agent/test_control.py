"""The agent's control handler against a real fake-NCCL job with the hook preloaded: status,
profile mode with GPU times on the bus, a targeted pause of every rank, GEMM and P2P benchmarks
that find the injected slow GPU and slow link, and a resume after which the job completes."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from greyhound.core.p2p_rounds import ring_rounds
from greyhound.fakejob import FakeJob, FakeJobSpec, native_build_dir
from services.agent.service import run_agent
from services.agent.settings import AgentSettings
from services.common.bus.auth import agent_user
from services.common.bus.client import ensure_streams
from services.common.bus.contract import (
    BenchItem,
    CollectiveBatch,
    ControlReply,
    ControlRequest,
    Subjects,
)
from services.common.bus.control import request
from services.common.runtime import start_service
from services.common.settings import Settings
from tests.conftest import Bus

AGENT = "ctl-agent"
JOB = "ctljob"
WORLD = 4
SIZES = (16 << 20, 32 << 20, 64 << 20)  # the paper's P2P sizes: at 10 GB/s, 1.6 to 6.4 ms


@dataclass
class Running:
    job: FakeJob
    nc: NATS  # the validator's: it may ask anything of an agent
    watch: NATS  # the operator's: it hears what the agent publishes


async def _ask(nc: NATS, **kw: object) -> ControlReply:
    return await request(nc, AGENT, ControlRequest(job_id=JOB, **kw))


async def _until(pred: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if await pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
async def running(bus: Bus, tmp_path_factory: pytest.TempPathFactory
                  ) -> AsyncIterator[Running]:
    root = tmp_path_factory.mktemp("ctl")
    settings = Settings(nats_url=bus.url, shm_dir=root / "shm", data_dir=root / "data")
    spec = FakeJobSpec(world_size=WORLD, iters=500, compute_ms=5.0, bytes=1 << 16, job_id=JOB,
                       compute_busy=0.0)
    job = FakeJob(spec, workdir=root / "w", hook=native_build_dir() / "libgreyhound_hook.so",
                  shm_dir=Path(settings.shm_dir))
    stop = asyncio.Event()
    with job:
        nc = await bus.connect("validator")
        watch = await bus.connect()
        await ensure_streams(nc.jetstream(), settings)  # the central services' part, not the agent's
        ctx = await start_service("agent", settings, need_db=False,
                                  backends=bus.backends(agent_user(AGENT)))
        agent = asyncio.create_task(run_agent(ctx, stop, agent_id=AGENT, job=[JOB],
                                              settings=AgentSettings(poll_s=0.02)))

        async def all_ranks() -> bool:
            with contextlib.suppress(Exception):
                return len((await _ask(nc, action="status", timeout_s=1.0)).ranks) == WORLD
            return False

        try:
            await _until(all_ranks, 30, "the agent to serve every rank")
            yield Running(job, nc, watch)
        finally:
            stop.set()
            await agent
            await ctx.close()
            await nc.drain()
            await watch.drain()


async def test_status_reports_every_rank_and_its_communicator(running: Running) -> None:
    reply = await _ask(running.nc, action="status")
    assert reply.ok and reply.agent_id == AGENT
    assert [r.rank for r in reply.ranks] == list(range(WORLD))
    for r in reply.ranks:
        assert r.mode == "monitor" and not r.paused
        assert len(r.comms) == 1 and r.comms[0].nranks == WORLD
        assert r.comms[0].comm_rank == r.rank
    assert len({r.comms[0].comm_id for r in reply.ranks}) == 1


async def test_bad_requests_get_an_error_reply(running: Running) -> None:
    unknown = await _ask(running.nc, action="status", ranks=[0, 7])
    assert not unknown.ok and "[7]" in (unknown.error or "")
    idle = await _ask(running.nc, action="bench",
                      bench=[BenchItem(rank=0, kind="gemm", size=32, repeat=1)])
    assert not idle.ok and "not paused" in (idle.error or "")
    plain = await _ask(running.nc, action="pause", ranks=[0, 1])
    assert not plain.ok and "pause_comm_id" in (plain.error or "")
    msg = await running.nc.request(Subjects.control(JOB, AGENT), b'{"job_id": 3}', timeout=5)
    garbled = ControlReply.model_validate_json(msg.data)
    assert not garbled.ok and "bad request" in (garbled.error or "")
    assert (await _ask(running.nc, action="status")).ok  # still answering


async def test_profile_mode_publishes_collectives_with_gpu_times(running: Running) -> None:
    batches: list[CollectiveBatch] = []

    async def got(msg: Msg) -> None:
        batches.append(CollectiveBatch.model_validate_json(msg.data))

    sub = await running.watch.subscribe(Subjects.collectives(JOB, AGENT), cb=got)
    await running.watch.flush()
    reply = await _ask(running.nc, action="set_mode", mode="profile")
    assert reply.ok and {r.mode for r in reply.ranks} == {"profile"}

    async def profiled() -> bool:
        ranks = {r for b in batches for r, g in zip(b.rank, b.gpu_start_ns, strict=True) if g}
        return ranks == set(range(WORLD))

    await _until(profiled, 15, "profiled collectives of every rank")
    assert (await _ask(running.nc, action="set_mode", mode="monitor")).ok
    await sub.unsubscribe()
    b = next(b for b in batches if any(b.gpu_start_ns))
    i = next(i for i, g in enumerate(b.gpu_start_ns) if g)
    assert b.enter_ns[i] <= b.exit_ns[i] and b.gpu_start_ns[i] <= b.gpu_end_ns[i]
    # Wall clock: within a minute of now, not monotonic nanoseconds since boot.
    assert abs(b.enter_ns[i] / 1e9 - b.ts) < 60 and b.nranks[i] == WORLD


async def test_pause_bench_resume(running: Running) -> None:
    nc, job = running.nc, running.job
    status = await _ask(nc, action="status")
    comm = status.ranks[0].comms[0].comm_id
    seq = max(r.comms[0].last_seq_entered for r in status.ranks) + 2
    reply = await _ask(nc, action="pause", pause_comm_id={r: comm for r in range(WORLD)},
                       pause_seq=seq)
    assert reply.ok

    async def all_paused() -> bool:
        return all(r.paused for r in (await _ask(nc, action="status")).ranks)

    await _until(all_paused, 10, "every rank to park")
    try:
        job.faults.set("slow_rank 2 2.0")
        gemm = await _ask(nc, action="bench", timeout_s=30, bench=[
            BenchItem(rank=r, kind="gemm", size=64, repeat=9) for r in range(WORLD)])
        job.faults.clear()
        assert gemm.ok and {o.state for o in gemm.results} == {"done"}, gemm
        best = {o.item.rank: min(o.durations_ns) for o in gemm.results}
        assert max(best, key=best.__getitem__) == 2, best
        assert best[2] > 1.5 * statistics.median(best[r] for r in (0, 1, 3)), best

        # Transfers run on a benchmark communicator split from the job's (every rank asks).
        split = await _ask(nc, action="bench", timeout_s=30, bench=[
            BenchItem(rank=r, kind="split", comm_id=comm) for r in range(WORLD)])
        assert split.ok and {o.state for o in split.results} == {"done"}, split
        job.faults.set("slow_link 1 2 4.0")
        link_ns: dict[tuple[int, int], int] = {}
        for pairs in ring_rounds(range(WORLD)):
            items = [BenchItem(rank=src, kind="send", size=s, repeat=3, comm_id=comm, peer=dst)
                     for src, dst in pairs for s in SIZES] + [
                     BenchItem(rank=dst, kind="recv", size=s, repeat=3, comm_id=comm, peer=src)
                     for src, dst in pairs for s in SIZES]
            p2p = await _ask(nc, action="bench", timeout_s=30, bench=items)
            assert p2p.ok and {o.state for o in p2p.results} == {"done"}, p2p
            for o in p2p.results:
                key = (o.item.rank, o.item.peer) if o.item.kind == "send" else \
                    (o.item.peer, o.item.rank)
                link_ns[key] = link_ns.get(key, 0) + min(o.durations_ns)
        job.faults.clear()
        assert set(link_ns) == {(0, 1), (1, 2), (2, 3), (3, 0)}
        assert max(link_ns, key=link_ns.__getitem__) == (1, 2), link_ns
        assert link_ns[1, 2] > 2.5 * statistics.median(link_ns.values()), link_ns
        # Training really stopped while benchmarks ran.
        assert all(r.paused for r in (await _ask(nc, action="status")).ranks)
    finally:
        assert (await _ask(nc, action="resume")).ok
    assert await asyncio.to_thread(job.wait, 60) == [0] * WORLD
