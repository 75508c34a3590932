"""Control follows the file, not the path: after a rank restarts (a new ring at the same path)
a pause goes to the live process's file, and what the agent held for the old file is dropped;
rings that are deleted are drained once more and closed, and a job whose rings are all gone is
evicted with its control subscriptions."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from greyhound import hookabi as H
from services.agent.collector import Collector
from services.agent.control import AgentControl
from services.agent.service import NodeAgent
from services.agent.settings import AgentSettings
from services.common.bus.auth import agent_user
from services.common.bus.client import ensure_streams
from services.common.bus.contract import ControlReply, ControlRequest
from services.common.settings import Settings
from tests.conftest import Bus
from tests.services.agent.forge import good_ring, iterations

JOB = "restart"


async def _ask(ctl: AgentControl, **kw: Any) -> ControlReply:
    req = ControlRequest(job_id=JOB, **kw)
    return await ctl.answer(JOB, req.model_dump_json().encode())


async def test_a_pause_after_a_restart_reaches_the_new_process(tmp_path: Path) -> None:
    col = Collector(tmp_path, JOB)
    old = good_ring(tmp_path, JOB, 0, iters=5)
    col.scan()
    ctl = AgentControl("a1", {JOB: col})
    assert (await _ask(ctl, action="set_mode", mode="profile")).ok
    assert old.control.mode == "profile"
    # The rank restarts: its hook writes a new ring and renames it over the old path.
    new = good_ring(tmp_path, JOB, 0, iters=5)
    assert new.path == old.path
    assert [s.file_id for s in col.scan()] == [H.RingReader(new.path).file_id]
    ctl.prune()
    assert (await _ask(ctl, action="pause", ranks=[0], pause_comm_id={0: 7},
                       pause_seq=9)).ok
    assert new.control.pause_requested() and new.control.pause_target() == (7, 9)
    assert not old.control.pause_requested()  # the dead process's file is left alone
    assert new.control.mode == "monitor"  # a new process starts in monitor mode
    assert len(ctl._controls) == 1  # the old file's control block was let go
    col.drain()
    await ctl.close()
    col.close()
    old.close()
    new.close()


async def test_deleted_rings_are_drained_then_closed_and_the_job_evicted(
        bus: Bus, tmp_path: Path) -> None:
    central = await bus.connect("tracker")  # the central services declare the streams
    await ensure_streams(central.jetstream(), Settings())
    await central.close()
    nc = await bus.connect(agent_user("evict-agent"))
    js = nc.jetstream()
    agent = NodeAgent(tmp_path, js, agent_id="evict-agent", settings=AgentSettings())
    ctl = AgentControl(agent.agent_id, agent.collectors)
    w = good_ring(tmp_path, JOB, 0, iters=5)
    agent.scan()
    await ctl.sync_jobs(nc)
    agent.collect_iterations()
    stream = next(iter(agent.collectors[JOB].streams.values()))
    assert (await _ask(ctl, action="status")).ok and len(ctl._controls) == 1
    w.append(iterations(3, start_ns=5_000_000_000))  # written just before the process exits
    w.path.unlink()  # the hook removes its ring at exit
    w.close()
    agent.scan()
    agent.collect_iterations()  # the last records are still read, then the file is closed
    assert stream.reader.cursor == len(iterations(8))
    assert JOB not in agent.collectors
    await ctl.sync_jobs(nc)
    assert ctl._subs == {} and ctl._controls == {}
    await asyncio.sleep(0)
    await ctl.close()
    await nc.close()
