"""A rank whose hook found neither a CUDA runtime nor the driver API has no GPU completion marks:
its hang watch and timings rest on host time alone. The agent says so in its hello, and again
when a rank it announced before its hook decided turns out to be one."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, cast

from nats.js import JetStreamContext

from greyhound import hookabi as H
from services.agent.service import NodeAgent
from services.agent.settings import AgentSettings
from services.common.bus.contract import AgentHello
from tests.services.agent.forge import poke

JOB = "blind"


def _hellos(agent: NodeAgent) -> list[AgentHello]:
    out = [m for _, m in agent.backlog if isinstance(m, AgentHello)]
    agent.backlog.clear()
    return out


def _ring(shm: Path, rank: int, api: H.GpuApi) -> H.RingWriter:
    return H.RingWriter(H.ring_path(shm, JOB, rank), job=JOB, rank=rank, host="h", pid=0,
                        device=rank, capacity=64, comms=[H.CommRow(7, rank, 2)], gpu_api=api)


def test_live_ranks_are_announced_again_every_hello_period(tmp_path: Path) -> None:
    """The tracker lets another agent take a rank only once its holder stopped announcing it,
    so an agent announces its live ranks again every GREYHOUND_AGENT_HELLO_S."""
    agent = NodeAgent(tmp_path, cast(JetStreamContext, None), agent_id="a1", jobs=[JOB],
                      settings=AgentSettings(hello_s=2.0))
    rings = [_ring(tmp_path, r, H.GpuApi.DRIVER) for r in (0, 1)]
    agent.scan()
    assert [[r.rank for r in h.ranks] for h in _hellos(agent)] == [[0, 1]]
    agent.scan()
    assert _hellos(agent) == []  # within the period: nothing
    time.sleep(2.1)
    agent.scan()
    assert [[r.rank for r in h.ranks] for h in _hellos(agent)] == [[0, 1]]
    for col in agent.collectors.values():
        col.close()
    for w in rings:
        w.close()


def test_ranks_without_gpu_marks_are_named_in_the_hello(tmp_path: Path) -> None:
    agent = NodeAgent(tmp_path, cast(JetStreamContext, None), agent_id="a1", jobs=[JOB],
                      settings=AgentSettings())
    rings: list[Any] = [_ring(tmp_path, 0, H.GpuApi.NONE), _ring(tmp_path, 1, H.GpuApi.UNKNOWN),
                        _ring(tmp_path, 2, H.GpuApi.DRIVER)]
    agent.scan()
    (hello,) = _hellos(agent)
    assert [r.rank for r in hello.ranks] == [0, 1, 2] and hello.marks_off == [0]
    agent.scan()
    assert _hellos(agent) == []  # nothing new
    # rank 1's hook decides later: no CUDA in its process either
    poke(rings[1].path, "gpu_api", int(H.GpuApi.NONE))
    agent.scan()
    (again,) = _hellos(agent)
    assert [r.rank for r in again.ranks] == [1] and again.marks_off == [1]
    agent.scan()
    assert _hellos(agent) == []
    for col in agent.collectors.values():
        col.close()
    for w in rings:
        w.close()
