"""A partitioned service's periodic queries (the planner's due proposals and approved plans, the
analyzer's unfinished localisations) filter their jobs in SQL, before the limit and the row
locks, against real Postgres: a backlog of another partition's older rows neither fills this
partition's limit nor, locked by its own process, hides this partition's rows."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from services.common.db import repository as repo
from services.common.db.documents import Culprit, Empty, Evidence, MicrobatchParams
from services.common.db.models import Plan
from services.common.ownership import Partition, partition_of

S2 = MicrobatchParams(kind="microbatch", microbatches=[5, 3, 4, 4], previous=[4, 4, 4, 4],
                      times=[1.0, 2.0, 1.0, 1.0], multiple_of=1, slow_dp_groups=[1],
                      makespan_before=8.0, makespan_after=6.0)
P0, P1 = Partition(0, 2), Partition(1, 2)


def _jobs(partition: int, n: int) -> list[str]:
    names = (f"job-{i}" for i in itertools.count())
    return list(itertools.islice((j for j in names if partition_of(j, 2) == partition), n))


async def _backlog(session: AsyncSession, jobs: list[str], *, expired_ago_s: float,
                   approved: bool = False) -> list[str]:
    """One incident left unlocalised and one plan, past its decision time, per job."""
    ids = []
    for job in jobs:
        await repo.touch_job(session, job)
        inc = await repo.open_incident(session, job_id=job, kind="slowdown",
                                       dedup_key="slowdown", severity=1.5, summary="s",
                                       culprit=Culprit(), evidence=Evidence(),
                                       stage_detail=Empty())
        plan = await repo.create_plan(
            session, incident_id=inc.id, job_id=job, strategy="S2", params=S2,
            policy="approval", expected_gain=None,
            expires_at=datetime.now(UTC) - timedelta(seconds=expired_ago_s))
        assert plan is not None
        if approved:
            repo.move_plan(plan, "approve")
        ids.append(plan.id)
    await session.commit()
    return ids


def _job_ids(plans: list[Plan]) -> set[str]:
    return {p.job_id for p in plans}


async def test_a_partition_sees_its_rows_past_another_partitions_backlog(
        sessions: async_sessionmaker[AsyncSession]) -> None:
    mine, theirs = _jobs(1, 2), _jobs(0, 6)
    async with sessions() as session:
        await _backlog(session, theirs, expired_ago_s=600.0)  # older: first in every order
        await _backlog(session, mine, expired_ago_s=60.0)
    async with sessions() as session:
        # unfiltered, the limit is filled by the other partition's backlog
        assert _job_ids(list(await repo.due_proposals(session, datetime.now(UTC), limit=3))
                        ) <= set(theirs)
        await session.rollback()
        assert _job_ids(list(await repo.due_proposals(session, datetime.now(UTC), limit=3,
                                                      jobs=P1.jobs))) == set(mine)
        await session.rollback()
        found = await repo.unlocalized_incidents(session, "slowdown", limit=3, jobs=P1.jobs)
        assert {i.job_id for i in found} == set(mine)
        assert {i.job_id for i in await repo.unlocalized_incidents(session, "slowdown", limit=3)
                } <= set(theirs)


async def test_one_partitions_locks_hide_nothing_from_another(
        sessions: async_sessionmaker[AsyncSession]) -> None:
    mine, theirs = _jobs(1, 2), _jobs(0, 4)
    async with sessions() as session:
        await _backlog(session, theirs, expired_ago_s=600.0, approved=True)
        await _backlog(session, mine, expired_ago_s=60.0, approved=True)
    async with sessions() as other, sessions() as this:
        # partition 0's planner holds its approved plans (its transaction still open) ...
        held = await repo.approved_undelivered(other, ("S2",), limit=100, jobs=P0.jobs)
        assert _job_ids(list(held)) == set(theirs)
        # ... and partition 1's finds its own, none of them locked by the other
        got = await repo.approved_undelivered(this, ("S2",), limit=100, jobs=P1.jobs)
        assert _job_ids(list(got)) == set(mine)
        await this.rollback()
        await other.rollback()
    async with sessions() as other, sessions() as this:
        # as it was: filtered after the query, partition 0's locks took every row
        assert len(await repo.approved_undelivered(other, ("S2",), limit=100)) == 6
        assert list(await repo.approved_undelivered(this, ("S2",), limit=100,
                                                    jobs=P1.jobs)) == []
        await this.rollback()
        await other.rollback()
    async with sessions() as session:  # one process with every job still sees them all
        everything = await repo.approved_undelivered(session, ("S2",), limit=100,
                                                     jobs=Partition().jobs)
        assert _job_ids(list(everything)) == set(mine) | set(theirs)
