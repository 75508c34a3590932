"""An agent that (re)starts clears what a dead predecessor left in the rings: a job parked by a
validation whose requester died resumes at once, not when its lease ends, and profile mode goes
back to monitor."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

from greyhound import hookabi as H
from greyhound.fakejob import FakeJob, FakeJobSpec, native_build_dir
from services.agent.collector import Collector
from services.agent.control import AgentControl
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
        ctl = [r._map.ctl for r in readers]
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
