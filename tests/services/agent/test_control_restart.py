"""The agent's part in a pause's lease: it writes the lease a request carries into the rings, so
a job whose validator died resumes when the lease ends; and when it (re)starts it clears what a
dead predecessor left there: a parked job resumes at once, not when its lease ends, and profile
mode goes back to monitor."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

from greyhound import hookabi as H
from greyhound.fakejob import FakeJob, FakeJobSpec, native_build_dir
from greyhound.hookabi.mapping import RingMapping
from services.agent.collector import Collector
from services.agent.control import AgentControl
from services.common.bus.contract import ControlRequest
from tests.native.helpers import pause_then_die, wait_rings

LEASE_S = 120.0  # far longer than the test: only the agent can end this pause in time


def test_a_restarted_agent_releases_a_job_its_predecessor_paused(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    # Long enough for the pausing process to start up and park it on a loaded machine.
    spec = FakeJobSpec(world_size=2, iters=3000, compute_ms=1, bytes=4096, job_id="stale")
    with FakeJob(spec, workdir=tmp_path / "w", hook=native_build_dir() / "libgreyhound_hook.so",
                 shm_dir=shm) as job:
        rings = wait_rings(shm, "stale", 2)
        job.wait_iteration(0, 5, 30)
        readers = [H.RingReader(p) for p in rings]
        for r in readers:
            r.control().set_mode("profile")
        p = pause_then_die(rings, LEASE_S)
        assert p.returncode == -signal.SIGKILL and b"paused" in p.stdout, p.stderr
        ctl = [RingMapping(r.path).ctl for r in readers]
        assert all(int(c["paused"]) == 1 for c in ctl)

        collector = Collector(shm, "stale")
        assert len(collector.scan()) == 2
        agent = AgentControl("restarted", {"stale": collector})
        t0 = time.monotonic()
        agent.adopt_rings()
        assert job.wait(60) == [0, 0]
        took = time.monotonic() - t0
        asyncio.run(agent.close())
    assert took < LEASE_S / 4  # released by the agent, not by the lease
    for c in ctl:
        assert int(c["pause_count"]) == 1 and int(c["lease_expired"]) == 0
        assert int(c["pause_request"]) == 0 and int(c["mode"]) == H.Mode.MONITOR


def test_the_agent_writes_the_requested_lease_and_the_job_resumes_when_it_ends(
        tmp_path: Path) -> None:
    """A validator pauses through the agent with a lease, then is never heard of again."""
    shm = tmp_path / "shm"
    spec = FakeJobSpec(world_size=2, iters=3000, compute_ms=1, bytes=4096, job_id="leased")
    with FakeJob(spec, workdir=tmp_path / "w", hook=native_build_dir() / "libgreyhound_hook.so",
                 shm_dir=shm) as job:
        wait_rings(shm, "leased", 2)
        job.wait_iteration(0, 5, 30)
        collector = Collector(shm, "leased")
        collector.scan()
        agent = AgentControl("agent", {"leased": collector})
        agent.adopt_rings()
        comms = {s.rank: s.reader.comms()[0] for s in collector.streams.values()}
        seq = max(int(c["last_seq_entered"]) for c in comms.values()) + 3
        req = ControlRequest(job_id="leased", action="pause", lease_s=2.0, pause_seq=seq,
                             pause_comm_id={r: int(c["comm_id"]) for r, c in comms.items()})
        asked = time.monotonic_ns()
        reply = asyncio.run(agent.answer("leased", req.model_dump_json().encode()))
        assert reply.ok, reply.error
        ctl = [RingMapping(s.path).ctl for s in collector.streams.values()]
        for c in ctl:  # CLOCK_MONOTONIC, two seconds out
            assert asked + 2_000_000_000 <= int(c["pause_lease_ns"]) <= time.monotonic_ns() + 2_000_000_000
        deadline = time.monotonic() + 30
        while not all(int(c["lease_expired"]) == 1 for c in ctl) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(int(c["pause_count"]) == 1 and int(c["lease_expired"]) == 1 for c in ctl)
        assert time.monotonic_ns() - asked >= 2_000_000_000
        assert job.wait(60) == [0, 0]
        asyncio.run(agent.close())
