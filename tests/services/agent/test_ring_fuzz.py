"""Every ring is untrusted input: broken, truncated, foreign and random rings next to good ones
(a header naming another job, a file another user owns: when the test runs as root).

Each bad ring is reported (with the reason the checks give) and skipped; the good rings are
still drained and published; the agent's loop keeps running; memory stays bounded whatever a
header claims (measured with tracemalloc, which sees numpy's buffers).
"""

from __future__ import annotations

import asyncio
import os
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import numpy as np
import pytest
from nats.js import JetStreamContext

from greyhound import hookabi as H
from services.agent.collector import Collector
from services.agent.service import NodeAgent
from services.agent.settings import AgentSettings
from services.common.bus.auth import agent_user
from services.common.bus.client import ensure_streams
from services.common.bus.contract import IterationBatch, Subjects
from services.common.settings import Settings
from tests.conftest import Bus
from tests.services.agent.forge import good_ring, header_offset, iterations, poke

JOB = "fuzz"
GOOD = (0, 1)
PEAK_LIMIT = 64 << 20  # bytes traced at the worst moment of a tick, all rings included


def _breakers() -> dict[int, tuple[str, tuple[str, int]]]:
    """rank -> (expected reason, how the ring is broken)."""
    return {
        10: ("capacity", ("capacity", 0)),
        11: ("capacity", ("capacity", 1000)),
        12: ("capacity", ("capacity", 1 << 30)),
        13: ("offsets", ("records_offset", 1 << 40)),
        14: ("offsets", ("control_offset", 0)),
        15: ("offsets", ("comms_offset", 4096 + 64)),
        16: ("truncated", ("file_bytes", 1 << 34)),
        17: ("record_bytes", ("record_bytes", 120)),  # an older hook, same version number
        18: ("comm_table", ("max_peers", 32)),
        19: ("version", ("version", 2)),
        20: ("magic", ("magic", 0x1234)),
        21: ("rank", ("rank", -5)),
        22: ("rank", ("rank", 99)),  # the header's rank is not the file name's
        23: ("anchors", ("wall_anchor_ns", (1 << 64) - 1)),
        24: ("head", ("head", 1 << 40)),  # far ahead of the cursor: found on the first poll
        25: ("head", ("consumed", 1 << 20)),  # the cursor beyond the head
    }


def _build(shm: Path) -> dict[Path, str]:
    """Good rings GOOD and a zoo of bad ones; returns bad path -> expected reason."""
    for r in GOOD:
        good_ring(shm, JOB, r).close()
    expected: dict[Path, str] = {}
    for rank, (reason, (field, value)) in _breakers().items():
        w = good_ring(shm, JOB, rank)
        path = w.path
        w.close()
        poke(path, field, value)
        expected[path] = reason
    trunc = H.ring_path(shm, JOB, 30)
    good_ring(shm, JOB, 30).close()
    os.truncate(trunc, 6000)
    expected[trunc] = "truncated"
    link = H.ring_path(shm, JOB, 31)
    link.symlink_to(H.ring_path(shm, JOB, 0))
    expected[link] = "not_a_file"
    fifo = H.ring_path(shm, JOB, 32)
    os.mkfifo(fifo)
    expected[fifo] = "not_a_file"
    H.ring_path(shm, JOB, 33).mkdir()
    expected[H.ring_path(shm, JOB, 33)] = "IsADirectoryError"
    # another job's ring put in this job's directory: it must not speak for this job
    other = good_ring(shm, JOB, 34)
    other.close()
    poke(other.path, "job", b"another-job".ljust(64, b"\0"))
    expected[other.path] = "job"
    if os.geteuid() == 0:  # a file another user owns in the job's directory
        foreign = good_ring(shm, JOB, 35)
        foreign.close()
        os.chown(foreign.path, 4242, 4242)
        expected[foreign.path] = "owner"
    return expected


def _random_rings(shm: Path, n: int, seed: int = 13) -> list[Path]:
    """Rings whose header (after a valid magic and version, half of them) or comm table or
    records are random bytes."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        rank = 100 + i
        w = good_ring(shm, JOB, rank, capacity=64, iters=10)
        path = w.path
        part = i % 3
        if part == 0:
            hdr = bytearray(rng.bytes(H.HEADER_DTYPE.itemsize))
            if i % 2:
                hdr[0:12] = np.array([H.MAGIC], "<u8").tobytes() + np.array(
                    [H.LAYOUT_VERSION], "<u4").tobytes()
            w._map.mm[0:len(hdr)] = bytes(hdr)
        elif part == 1:
            w._map.comm_table.view(np.uint8)[:] = np.frombuffer(
                rng.bytes(w._map.comm_table.nbytes), np.uint8)
        else:
            w._map.records.view(np.uint8)[:] = np.frombuffer(
                rng.bytes(w._map.records.nbytes), np.uint8)
            w._map.hdr["head"] = 64
        w.close()
        out.append(path)
    return out


@pytest.fixture()
async def agent(bus: Bus, tmp_path: Path) -> NodeAgent:
    agent_id = f"fuzz-{tmp_path.name[-8:]}"
    nc = await bus.connect(agent_user(agent_id))
    return NodeAgent(tmp_path / "shm", nc.jetstream(), agent_id=agent_id,
                     settings=AgentSettings(poll_s=0.01))


@pytest.fixture()
async def watch(bus: Bus) -> AsyncIterator[JetStreamContext]:
    """The operator's: declares the streams (the central services' part) and reads what the
    agent stored."""
    nc = await bus.connect()
    await ensure_streams(nc.jetstream(), Settings())
    yield nc.jetstream()
    await nc.close()


async def _tick(agent: NodeAgent) -> None:
    agent.scan()
    agent.collect_iterations()
    agent.collect_counters()
    await agent.flush()


async def test_bad_rings_are_reported_and_skipped_and_good_ones_served(
        agent: NodeAgent, watch: JetStreamContext) -> None:
    shm = agent.shm_dir
    expected = _build(shm)
    random = _random_rings(shm, 30)
    tracemalloc.start()
    try:
        for _ in range(3):
            await _tick(agent)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"fuzz: {len(expected) + len(random) + len(GOOD)} rings, 3 ticks, traced peak "
          f"{peak / 2**20:.2f} MiB")
    bad = agent.health.bad
    for path, reason in expected.items():
        assert path in bad and bad[path].reason == reason, (path.name, bad.get(path))
    served = {s.rank: s for s in agent.collectors[JOB].streams.values()}
    assert set(GOOD) <= set(served)
    assert not set(served) & {int(p.stem.split("-")[1]) for p in expected}
    for r in GOOD:  # every good record was consumed
        assert served[r].reader.cursor == len(iterations(40))
    # every random ring either attached (and was sanitised) or was reported: none escaped
    assert all(p in bad or int(p.stem.split("-")[1]) in served for p in random)
    assert agent.loop_errors == 0
    assert peak < PEAK_LIMIT, f"peak {peak / 2**20:.1f} MiB"
    published = await _iterations(agent, watch)
    assert set(GOOD) <= published


async def _iterations(agent: NodeAgent, js: JetStreamContext) -> set[int]:
    """Ranks of every iteration batch the agent published for JOB."""
    sub = await js.pull_subscribe(Subjects.iterations(JOB, agent.agent_id), durable=None)
    ranks: set[int] = set()
    try:
        while True:
            try:
                msgs = await sub.fetch(64, timeout=1.0)
            except TimeoutError:
                return ranks
            for m in msgs:
                ranks.update(IterationBatch.model_validate_json(m.data).rank)
    finally:
        await sub.unsubscribe()


async def test_a_ring_shrunk_while_attached_costs_that_ring_only(
        agent: NodeAgent, watch: JetStreamContext) -> None:
    shm = agent.shm_dir
    alive = good_ring(shm, JOB, 0, iters=10)
    good_ring(shm, JOB, 1, iters=10).close()
    await _tick(agent)
    victim = H.ring_path(shm, JOB, 1)
    streams = agent.collectors[JOB].streams
    assert {s.rank for s in streams.values()} == set(GOOD)
    # A mapping of this file would now fault (SIGBUS) at the first touch past 6000 bytes.
    os.truncate(victim, 6000)
    alive.append(iterations(5, start_ns=10_000_000_000))  # the other rank goes on writing
    for _ in range(2):
        await _tick(agent)
    assert agent.health.bad[victim].reason == "truncated"
    assert [s.rank for s in streams.values()] == [0]
    assert next(iter(streams.values())).reader.cursor == len(iterations(15))
    assert agent.loop_errors == 0
    alive.close()


async def test_the_loop_keeps_running_among_bad_rings(
        agent: NodeAgent, watch: JetStreamContext) -> None:
    shm = agent.shm_dir
    _build(shm)
    _random_rings(shm, 9)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while loop.time() < deadline and not (agent.published and agent.health.bad):
            await asyncio.sleep(0.05)
        good_ring(shm, JOB, 2, iters=10).close()  # a ring appearing later is served
        while loop.time() < deadline and 2 not in {
                s.rank for c in agent.collectors.values() for s in c.streams.values()}:
            await asyncio.sleep(0.05)
        assert not task.done()
        assert 2 in {s.rank for c in agent.collectors.values() for s in c.streams.values()}
        status = agent.status()
        assert status["published"] > 0 and status["bad_rings"] and status["loop_errors"] == 0
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def test_a_huge_lag_is_read_in_bounded_polls(tmp_path: Path) -> None:
    """A 2^20-record ring full to the brim: each poll copies at most MAX_POLL_RECORDS."""
    cap = 1 << 20
    w = H.RingWriter(H.ring_path(tmp_path, JOB, 0), job=JOB, rank=0, host="h", pid=0,
                     device=0, capacity=cap)
    w._map.hdr["head"] = cap  # every slot claimed (stamps left 0: nothing is complete)
    w.close()
    reader = H.RingReader(H.ring_path(tmp_path, JOB, 0))
    tracemalloc.start()
    try:
        got = reader.poll()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"2^20-record lag: one poll, traced peak {peak / 2**20:.2f} MiB")
    assert len(got) == 0  # the first slot is not complete: nothing handed out yet
    assert peak < 3 * H.MAX_POLL_RECORDS * H.RECORD_DTYPE.itemsize, f"{peak / 2**20:.1f} MiB"
    reader.close()


def test_header_fields_read_back_as_poked(tmp_path: Path) -> None:
    w = good_ring(tmp_path, JOB, 0)
    w.close()
    poke(w.path, "capacity", 0)
    assert header_offset(w.path, "capacity") == 0
    col = Collector(tmp_path, JOB)
    assert col.scan() == [] and col.health.bad[w.path].reason == "capacity"


def test_a_symlinked_job_directory_is_not_read(tmp_path: Path) -> None:
    """A local user links a directory of theirs, with rings naming job ``victim``, under that
    job's name: the agent lists no such job and its collector reads nothing through the link
    (it followed directory symlinks, and took the job from the link's name)."""
    shm, theirs = tmp_path / "shm", tmp_path / "theirs"
    shm.mkdir()
    good_ring(theirs, "victim", 0).close()  # a well-formed ring of "victim", in their tree
    (shm / "victim").symlink_to(theirs / "victim", target_is_directory=True)
    good_ring(shm, JOB, 0).close()
    agent = NodeAgent(shm, cast(JetStreamContext, None), agent_id="a1", settings=AgentSettings())
    assert agent._job_dirs() == [JOB]
    col = Collector(shm, "victim")
    assert col.scan() == [] and not col.streams
    col.close()
