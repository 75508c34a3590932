"""GPU health through the running agent: a fake-NCCL job (rank r on GPU r), the agent loading the
fake NVML, GpuHealth on gh.v1.<job>.gpu.<agent> with each GPU's ranks, a throttle and an Xid from
the fault file showing up, the on-demand ``gpu`` control action; and with NVML missing, no GPU
message at all while the rest of the agent carries on."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from greyhound.fakejob import FakeJob, FakeJobSpec, native_build_dir
from services.agent.service import run_agent
from services.agent.settings import AgentSettings
from services.common.bus.auth import agent_user
from services.common.bus.client import ensure_streams
from services.common.bus.contract import ControlRequest, GpuHealth, Subjects
from services.common.bus.control import request
from services.common.runtime import start_service
from services.common.settings import Settings
from tests.conftest import Bus

AGENT = "gpu-agent"
WORLD = 4


@dataclass
class Running:
    job: FakeJob
    nc: NATS
    health: asyncio.Queue[GpuHealth]
    iterations: list[int]
    job_id: str


@contextlib.asynccontextmanager
async def running(bus: Bus, root: Path, job_id: str, nvml_lib: str,
                  monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Running]:
    settings = Settings(nats_url=bus.url, shm_dir=root / "shm", data_dir=root / "data")
    spec = FakeJobSpec(world_size=WORLD, iters=3000, compute_ms=5.0, bytes=1 << 14,
                       job_id=job_id, compute_busy=0.0)
    job = FakeJob(spec, workdir=root / "w", hook=native_build_dir() / "libgreyhound_hook.so",
                  shm_dir=Path(settings.shm_dir))
    # the agent runs in this process: its fake NVML reads the job's fault file
    monkeypatch.setenv("FAKE_NCCL_FAULTS", str(job.faults.path))
    monkeypatch.setenv("FAKE_NVML_GPUS", "8")
    stop = asyncio.Event()
    with job:
        ctx = await start_service("agent", settings, need_db=False,
                                  backends=bus.backends(agent_user(AGENT)))
        nc = await bus.connect()  # the operator: it hears the agent's telemetry, asks like the analyzer
        await ensure_streams(nc.jetstream(), settings)  # the central services' part, not the agent's
        health: asyncio.Queue[GpuHealth] = asyncio.Queue()
        iterations: list[int] = []

        async def on_health(msg: Msg) -> None:
            await health.put(GpuHealth.model_validate_json(msg.data))

        async def on_iter(msg: Msg) -> None:
            iterations.append(1)

        subs = [await nc.subscribe(Subjects.gpu_health(job_id, AGENT), cb=on_health),
                await nc.subscribe(Subjects.iterations(job_id, AGENT), cb=on_iter)]
        await nc.flush()
        agent = asyncio.create_task(run_agent(
            ctx, stop, agent_id=AGENT, job=[job_id],
            settings=AgentSettings(poll_s=0.02, gpu_s=0.5, xid_poll_s=0.1, nvml_lib=nvml_lib)))
        try:
            yield Running(job, nc, health, iterations, job_id)
        finally:
            stop.set()
            await asyncio.wait_for(agent, timeout=20)
            for sub in subs:
                await sub.unsubscribe()
            await nc.close()
            await ctx.close()


async def next_health(r: Running, *, ranks: int = WORLD, timeout_s: float = 20.0) -> GpuHealth:
    """The next GpuHealth that covers ``ranks`` GPUs (the first may precede some rings)."""
    async with asyncio.timeout(timeout_s):
        while True:
            h = await r.health.get()
            if len(h.gpus) >= ranks:
                return h


async def test_agent_publishes_gpu_health_per_job(bus: Bus, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    lib = str(native_build_dir() / "fake" / "libnvidia-ml.so.1")
    async with running(bus, tmp_path, "gpujob", lib, monkeypatch) as r:
        h = await next_health(r)
        assert h.agent_id == AGENT and h.job_id == "gpujob"
        # only the job's GPUs (the fake node has 8), each with its rank from the ring
        assert [(g.index, g.ranks) for g in h.gpus] == [(i, [i]) for i in range(WORLD)]
        assert all(g.throttle == [] and g.sm_clock_mhz == 1980 for g in h.gpus)

        r.job.faults.set("nvml_throttle 2 thermal")
        r.job.faults.set("nvml_xid 1 79")
        async with asyncio.timeout(20):
            while True:
                h = await next_health(r)
                g = {x.index: x for x in h.gpus}
                if g[2].throttle and g[1].xids:
                    break
        assert g[2].throttle == ["sw_thermal", "hw_thermal"] and g[2].sm_clock_mhz == 1095
        assert [x.code for x in g[1].xids] == [79]
        assert g[0].throttle == [] and g[3].xids == []

        reply = await request(r.nc, AGENT, ControlRequest(job_id="gpujob", action="gpu",
                                                          ranks=[2], timeout_s=5))
        assert reply.ok and [(x.index, x.ranks, x.temperature_c) for x in reply.gpus] == [
            (2, [2], 87)]


async def test_without_nvml_no_gpu_message_and_the_agent_carries_on(
        bus: Bus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with running(bus, tmp_path, "nogpujob", str(tmp_path / "libnvidia-ml.so.1"),
                       monkeypatch) as r:
        r.job.wait_iteration(0, 20, timeout=60)
        await asyncio.sleep(2.0)  # four sampling periods
        reply = await request(r.nc, AGENT, ControlRequest(job_id="nogpujob", action="gpu",
                                                          timeout_s=5))
        before = len(r.iterations)
        await asyncio.sleep(0.5)
        assert r.health.empty()
        assert reply.ok and reply.gpus == []
        assert len(r.iterations) > before > 0  # telemetry still flows
