"""Analyzers split by job under leases (issue 21): a standby analyzer process does nothing while
the owner lives and, once the owner is killed with SIGKILL in the middle of a localisation,
takes the partition over and finishes that localisation once; with two partitions, two
analyzers split the jobs and a standby takes over the partition of one that stopped."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from nats.aio.msg import Msg

from services.analyzer.service import Analyzer, AnalyzerOwner
from services.analyzer.settings import AnalyzerSettings
from services.analyzer.slow import SlowLocalizer
from services.common.bus.auth import agent_user
from services.common.bus.client import publish
from services.common.bus.contract import ControlReply, ControlRequest, DetectionEvent, Subjects
from services.common.bus.streams import TELEMETRY, collectives_spec
from services.common.db import repository as repo
from services.common.db.models import Incident
from services.common.leases import owners
from services.common.ownership import Ownership, Partition, own_partitions, partition_of
from services.common.runtime import ServiceContext, start_service, supervise
from services.common.settings import Settings
from tests.conftest import Bus, new_bus
from tests.services.analyzer.helpers import register_ranks
from tests.services.common.pipeline import AGENTS, SLOW_RANK, StandInJob, collectives
from tests.services.common.service_procs import ServiceProcesses, until

STARTED_WITHIN_S = 40.0  # two interpreters starting at once on a loaded 2-core machine
TAKEOVER_WITHIN_S = 10.0  # a killed owner's lease frees with its connection; retry 0.5 s


@dataclass
class HeldJob(StandInJob):
    """The stand-in job, whose agents answer a profile request but send no collectives while
    ``hold``: the localisation waits, mid-window, for as long as the test needs."""

    hold: bool = True
    held: int = field(default=0)

    async def _answer(self, msg: Msg, agent: str) -> None:
        req = ControlRequest.model_validate_json(msg.data)
        if self.hold and req.action == "set_mode" and req.mode == "profile":
            self.held += 1
            await msg.respond(ControlReply(ok=True, agent_id=agent).model_dump_json().encode())
            return
        await super()._answer(msg, agent)


def _slowdown(job: str) -> DetectionEvent:
    return DetectionEvent(job_id=job, kind="slowdown", ranks=[0, 1, 2, 3], first_iteration=100,
                          detected_iteration=104, before_s=0.1, after_s=0.15, detected_ns=1,
                          evidence={"change": "onset", "healthy_s": 0.1})


def _hang(job: str) -> DetectionEvent:
    return DetectionEvent(job_id=job, kind="hang", ranks=[0, 1], first_iteration=-1,
                          detected_iteration=-1, before_s=0.1, after_s=70.0, detected_ns=1,
                          comm_id=7, stalled_s=70.0, threshold_s=60.0,
                          method=DetectionEvent.HANG_WATCH)


async def _incidents(ctx: ServiceContext, job: str) -> list[Incident]:
    async with ctx.db()() as session:
        return list(await repo.list_incidents(session, job_id=job))


def test_a_standby_finishes_the_localisation_of_an_owner_killed_mid_window_once(
        fresh_db_url: str, tmp_path: Path) -> None:
    """Two ``greyhound analyzer`` processes: the owner opens the incident and starts profiling;
    killed (SIGKILL) while the window waits, its lease frees with its connection; the standby,
    which consumed nothing until then, takes the partition, resumes that localisation (and no
    other) and records it: one localisation, one profile per agent, however often it resumes."""

    async def scenario(bus: Bus) -> None:
        procs = ServiceProcesses("analyzer", bus, fresh_db_url, tmp_path, {
            "GREYHOUND_ANALYZER_RESUME_EVERY_S": "0.5",  # a resume that repeated would show
            "GREYHOUND_ANALYZER_LEASE_RETRY_S": "0.5"})
        job = f"kill-{uuid.uuid4().hex[:6]}"
        async with bus.service("tracker", fresh_db_url) as ctx:
            await register_ranks(ctx, job)
            agents = HeldJob(bus, job)
            await agents.start()
            try:
                owner, standby = await procs.owner_and_standby(STARTED_WITHIN_S)
                await publish(ctx.js, Subjects.detection(job), _slowdown(job))

                async def profiling() -> bool:
                    return agents.held == len(AGENTS)

                await until("the owner to profile the job", 20.0, profiling)
                (inc,) = await _incidents(ctx, job)
                assert inc.status == "detected"
                os.kill(owner.pid, signal.SIGKILL)
                killed_at = time.monotonic()
                owner.wait(10)
                agents.hold = False

                async def taken() -> bool:
                    return await procs.owner() is standby

                await until("the standby to take the partition", TAKEOVER_WITHIN_S, taken)
                print(f"takeover: standby held the lease {time.monotonic() - killed_at:.2f}s "
                      "after the kill")

                async def localized() -> bool:
                    (row,) = await _incidents(ctx, job)
                    return row.status == "localized"

                await until("the standby to localise the incident", 30.0, localized)
                await asyncio.sleep(3.0)  # six more resume rounds: nothing is done again
                (inc,) = await _incidents(ctx, job)
                assert [e.stage for e in inc.timeline] == ["detected", "localized"]
                assert inc.culprit.ranks == [SLOW_RANK]
                assert agents.actions["set_mode:profile"] == len(AGENTS)  # profiled once more
                assert standby.poll() is None
            finally:
                await agents.close()
                procs.stop()
        mine, theirs = procs.log(owner), procs.log(standby)
        assert "analyzer owns partition 0 of 1" in mine
        assert f"incident {inc.id} detected" in mine and "detected (" not in theirs
        assert f"incident {inc.id} of job {job}: its localisation never finished" in theirs

    with new_bus("gh-an-kill-") as bus:
        asyncio.run(scenario(bus))


async def _collectives_by_partition(bus: Bus, jobs: list[str]) -> None:
    """Collectives of every job, sent as an agent sends them: each partition's collectives
    durable is given its own partition's jobs' only, by the server (the stream stores them
    under the job's partition)."""
    nc = await bus.connect(agent_user("node-a"))
    try:
        for i, job in enumerate(jobs):
            await publish(nc.jetstream(), Subjects.collectives(job, "node-a"),
                          collectives(job, "node-a", (0, 1), seed=i))
    finally:
        await nc.close()
    op = await bus.connect()
    try:
        for index in (0, 1):
            durable = collectives_spec(index, 2).durable

            async def delivered(durable: str = durable, index: int = index) -> bool:
                info = await op.jetstream().consumer_info(TELEMETRY, durable)
                want = sum(partition_of(j, 2) == index for j in jobs)
                assert info.delivered.consumer_seq <= want, (durable, info.delivered)
                return info.delivered.consumer_seq == want and not info.num_ack_pending

            await until(f"{durable} to be given its partition's collectives", 10.0, delivered)
    finally:
        await op.close()


@asynccontextmanager
async def _analyzer(bus: Bus, db_url: str, tmp: Path) -> AsyncIterator[
        tuple[AnalyzerOwner, asyncio.Event]]:
    """An analyzer in this process, partitions 2, its loop asking for either partition."""
    ctx = await start_service("analyzer", Settings(
        nats_url=bus.url, database_url=db_url, data_dir=tmp, tracker_partitions=2),
        backends=bus.backends("analyzer", db_url))
    work = ctx.work("analyzer")
    settings = AnalyzerSettings(lease_valid_s=2.0, lease_retry_s=0.2)
    owner = AnalyzerOwner(Analyzer(ctx, work), SlowLocalizer(ctx, work), settings)
    plan = Ownership.of("analyzer", 2, None, valid_s=2.0, retry_s=0.2)
    stop = asyncio.Event()
    task = asyncio.create_task(supervise(own_partitions(owner, plan, db_url, stop),
                                         work.relay(stop)))
    try:
        yield owner, stop
    finally:
        stop.set()
        await task
        await ctx.close()


def _handled(owner: AnalyzerOwner) -> tuple[int, int]:
    """Detections this owner's current consumer handled, and passed over as others'."""
    if not owner.consumers:
        return 0, 0
    stats = owner.consumers[0].stats
    return stats.handled, stats.elsewhere


def test_two_partitions_split_the_jobs_and_a_standby_takes_a_stopped_owners(
        fresh_db_url: str, tmp_path: Path) -> None:
    """Three analyzers, two partitions: each of two owns one and handles its jobs' detections
    only (every job one incident); the third stands by, and takes the partition of the owner
    that stops, handling that partition's jobs from then on."""
    first = [f"split-{i}-{uuid.uuid4().hex[:4]}" for i in range(10)]
    later = [f"after-{i}-{uuid.uuid4().hex[:4]}" for i in range(8)]
    assert {partition_of(j, 2) for j in first} == {0, 1}

    async def scenario(bus: Bus) -> None:
        # the detections' sender first: the streams are made for two partitions
        tracker = await start_service("tracker", Settings(
            nats_url=bus.url, database_url=fresh_db_url, data_dir=tmp_path, tracker_partitions=2),
            backends=bus.backends("tracker", fresh_db_url))
        try:
            async with _analyzer(bus, fresh_db_url, tmp_path) as (a, stop_a):
                await until("partition 0 owned", 20.0, lambda: _owned({0}))
                async with _analyzer(bus, fresh_db_url, tmp_path) as (b, _):
                    await until("partition 1 owned", 20.0, lambda: _owned({0, 1}))
                    async with _analyzer(bus, fresh_db_url, tmp_path) as (c, _):
                        assert (a.analyzer.part.index, b.analyzer.part.index) == (0, 1)
                        assert [x.spec.durable for x in a.consumers] == [
                            "analyzer-p0-of-2", "analyzer-collectives-p0-of-2"]
                        for job in first:
                            await publish(tracker.js, Subjects.detection(job), _hang(job))
                        await until("every incident", 30.0, lambda: _all_open(tracker, first))
                        await until("every ack", 10.0, lambda: _settled([a, b], len(first)))
                        mine = sum(partition_of(j, 2) == 0 for j in first)
                        assert _handled(a) == (mine, len(first) - mine)
                        assert _handled(b) == (len(first) - mine, mine)
                        assert c.consumers == []  # the standby consumed nothing
                        await _collectives_by_partition(bus, first)
                        stop_a.set()  # the owner of partition 0 stops in good order
                        await until("the standby to take over", 10.0, lambda: _serving(c))
                        assert c.analyzer.part.index == 0
                        for job in later:
                            await publish(tracker.js, Subjects.detection(job), _hang(job))
                        await until("every incident", 30.0, lambda: _all_open(tracker, later))
                        await until("every ack", 10.0, lambda: _settled([c], len(later)))
                        await until("every ack", 10.0,
                                    lambda: _settled([b], len(first) + len(later)))
                        now_mine = sum(partition_of(j, 2) == 0 for j in later)
                        # the new owner's durable was partition 0's: it resumes where a left
                        assert _handled(c) == (now_mine, len(later) - now_mine)
                        assert _handled(b) == (len(first) - mine + len(later) - now_mine,
                                               mine + now_mine)
                        for job in first + later:
                            (inc,) = await _incidents(tracker, job)
                            assert [e.stage for e in inc.timeline] == ["detected"]
        finally:
            await tracker.close()

    async def _owned(parts: set[int]) -> bool:
        return set(await owners(fresh_db_url, "analyzer")) >= parts

    async def _settled(owners_: list[AnalyzerOwner], n: int) -> bool:
        """Each owner's consumer has handled or passed over ``n`` detections (it sees every
        job's: its stats count once the incident is committed)."""
        return all(sum(_handled(o)) == n for o in owners_)

    async def _serving(owner: AnalyzerOwner) -> bool:
        return bool(owner.consumers)

    async def _all_open(ctx: ServiceContext, jobs: list[str]) -> bool:
        return all([await _incidents(ctx, j) for j in jobs])

    with new_bus("gh-an-split-", tracker_partitions=2) as bus:
        asyncio.run(scenario(bus))


@dataclass
class _Starts:
    """Stands in for the localizer: records which jobs' localisations were started."""

    started: list[str] = field(default_factory=list)
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    def start(self, incident_id: str, det: DetectionEvent, **_: object) -> bool:
        self.started.append(det.job_id)
        return False


async def test_with_two_partitions_an_analyzer_resumes_its_jobs_localisations_only(
        ctx: ServiceContext) -> None:
    jobs = [f"res-{i}-{uuid.uuid4().hex[:4]}" for i in range(8)]
    assert {partition_of(j, 2) for j in jobs} == {0, 1}
    opener = Analyzer(ctx, ctx.work("analyzer"))  # opens the incidents, localises none
    for job in jobs:
        await opener.consume(Subjects.detection(job), _slowdown(job))
    for index in (0, 1):
        starts = _Starts()
        analyzer = Analyzer(ctx, ctx.work("analyzer"), cast(SlowLocalizer, starts))
        analyzer.part = Partition(index, 2)
        mine = {j for j in jobs if partition_of(j, 2) == index}
        assert await analyzer.resume() == len(mine)
        assert set(starts.started) == mine and len(starts.started) == len(mine)
