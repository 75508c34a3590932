"""A forged pause never parks a rank: the bus refuses it before any agent sees it.

A real agent serves two rings on an embedded NATS that requires credentials. A client without
credentials cannot connect at all; the analyzer (which may ask for status and profile mode) and
another node's agent are refused on the validation subject by the server, and a pause sent on
the control subject is refused by the agent. The ring's control block is read on the hook's
side after each attempt: no pause request. The validator's pause does arrive (the check can
fail), and its resume clears it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from greyhound import hookabi as H
from services.agent.service import run_agent
from services.agent.settings import AgentSettings
from services.common.bus.auth import BusAuthError, agent_user
from services.common.bus.client import connect, ensure_streams
from services.common.bus.contract import ControlReply, ControlRequest, Subjects, Suspicion
from services.common.bus.control import request
from services.common.bus.refusals import PermissionDenied
from services.common.bus.streams import EVENTS
from services.common.embedded import EmbeddedNats
from services.common.runtime import Backends, start_service
from services.common.settings import Settings
from tests.services.agent.forge import good_ring

JOB = "pausejob"
NODE = "node-a"
REFUSED = PermissionDenied  # the server's refusal, as the connection reports it


@dataclass
class Running:
    server: EmbeddedNats
    rings: list[H.RingWriter]

    async def client(self, user: str) -> NATS:
        return await connect(self.server.url, name=f"test-{user}",
                             credentials=self.server.credentials(user))

    def pause_requested(self) -> list[bool]:
        return [w.control.pause_requested() for w in self.rings]


@pytest.fixture()
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    server = EmbeddedNats(tmp_path / "data")
    server.start()
    shm = tmp_path / "shm"
    rings = [good_ring(shm, JOB, r, iters=10) for r in (0, 1)]
    settings = Settings(nats_url=server.url, shm_dir=shm, data_dir=tmp_path / "data")
    central = await connect(server.url, name="test-central",
                            credentials=server.credentials("tracker"))
    await ensure_streams(central.jetstream(), settings)
    ctx = await start_service("agent", settings, need_db=False, backends=Backends(
        nats_url=server.url, database_url="",
        nats_credentials=server.credentials(agent_user(NODE))))
    stop = asyncio.Event()
    task = asyncio.create_task(run_agent(ctx, stop, agent_id=NODE,
                                         settings=AgentSettings(poll_s=0.02)))
    run = Running(server, rings)
    validator = await run.client("validator")
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while True:
            with contextlib.suppress(Exception):
                status = await request(validator, NODE, ControlRequest(
                    job_id=JOB, action="status", timeout_s=1.0))
                if len(status.ranks) == 2:
                    break
            assert loop.time() < deadline, "the agent never served the rings"
            await asyncio.sleep(0.1)
        yield run
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await ctx.close()
        for nc in (validator, central):
            await nc.close()
        for w in rings:
            w.close()
        server.stop()


def _pause() -> bytes:
    return ControlRequest(job_id=JOB, action="pause", ranks=[0, 1],
                          pause_comm_id={0: 7, 1: 7}, pause_seq=100).model_dump_json().encode()


async def test_a_pause_without_credentials_cannot_even_be_sent(running: Running) -> None:
    with pytest.raises(BusAuthError):
        await asyncio.wait_for(connect(running.server.url, name="forger"), 30)
    assert running.pause_requested() == [False, False]


async def test_a_pause_from_anyone_but_the_validator_is_refused(running: Running) -> None:
    analyzer = await running.client("analyzer")
    other = await running.client(agent_user("node-b"))
    try:
        for nc in (analyzer, other):  # the server drops it: no agent ever sees it
            with pytest.raises(REFUSED):
                await nc.request(Subjects.validation(JOB, NODE), _pause(), timeout=1.5)
        # On the control subject (which the analyzer may use) the agent itself refuses it.
        msg = await analyzer.request(Subjects.control(JOB, NODE), _pause(), timeout=10)
        reply = ControlReply.model_validate_json(msg.data)
        assert not reply.ok and "validation subject" in (reply.error or "")
        # status and profile mode stay the analyzer's to ask
        mode = await request(analyzer, NODE, ControlRequest(job_id=JOB, action="set_mode",
                                                            mode="monitor"))
        assert mode.ok
        await asyncio.sleep(0.2)
        assert running.pause_requested() == [False, False]
    finally:
        await analyzer.close()
        await other.close()


async def test_the_validators_pause_arrives_and_its_resume_clears_it(running: Running) -> None:
    validator = await running.client("validator")
    try:
        msg = await validator.request(Subjects.validation(JOB, NODE), _pause(), timeout=10)
        assert ControlReply.model_validate_json(msg.data).ok
        assert running.pause_requested() == [True, True]
        assert [w.control.pause_target() for w in running.rings] == [(7, 100), (7, 100)]
        resumed = await request(validator, NODE, ControlRequest(job_id=JOB, action="resume"))
        assert resumed.ok and running.pause_requested() == [False, False]
    finally:
        await validator.close()


async def test_a_forged_suspicion_is_refused_by_the_server(running: Running) -> None:
    """Only the analyzer publishes suspicions: without credentials nothing is sent at all, and
    every other user's (an agent's, the tracker's, the API's) is dropped before the stream."""
    forged = Suspicion(job_id=JOB, incident_id="0" * 32, kind="compute_slow", ranks=[0],
                       comm_ids=[]).model_dump_json().encode()
    with pytest.raises(BusAuthError):
        await asyncio.wait_for(connect(running.server.url, name="forger"), 30)
    for user in (agent_user(NODE), "tracker", "api"):
        nc = await running.client(user)
        try:
            with pytest.raises(REFUSED):
                await nc.jetstream().publish(Subjects.suspicion(JOB), forged, timeout=0.5)
        finally:
            await nc.close()
    api = await running.client("api")
    try:
        info = await api.jetstream().stream_info(EVENTS, subjects_filter=Subjects.suspicion(JOB))
        assert not (info.state.subjects or {}).get(Subjects.suspicion(JOB))
    finally:
        await api.close()
    assert running.pause_requested() == [False, False]
