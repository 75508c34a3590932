"""One node's bus password speaking for another job or agent, through the real tracker on the
authenticated nats-server and Postgres. The server lets agent ``evil`` publish only on subjects
ending in ``evil``, whatever their job; what the body says is the consumer's to check:

* an iteration batch on evil's subject of job B naming B's agent in its body, and one on evil's
  subject of job A saying it is job B's: dead-lettered (``subject_mismatch``), and the API's
  window of job B, read from the same stream, shows neither;
* evil's hello taking ranks of job B that B's agents hold: dead-lettered (``rank_taken``), the
  ranks still served by their agents (the validator pauses a job through them);
* a hello taking a rank whose holder stopped announcing it (a job restarted on other nodes) is
  accepted once the takeover time has passed.

Each fails on the code before the checks: the tracker recorded the body's job and agent.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import update

from services.api.telemetry import read_window
from services.common.bus.auth import agent_user
from services.common.bus.client import publish
from services.common.bus.contract import AgentHello, DeadLetter, IterationBatch, RankInfo, Subjects
from services.common.db import repository as repo
from services.common.db.models import Rank
from services.tracker.settings import TrackerSettings
from tests.conftest import Bus
from tests.services.common.pipeline import AGENTS, Pipeline, StandInJob, pipeline
from tests.services.common.test_poison import all_letters


def _batch(job: str, agent: str, duration_s: float) -> IterationBatch:
    return IterationBatch(job_id=job, agent_id=agent, rank=[0, 1], iteration=[7, 7],
                          end_ns=[1_700_000_000_000_000_000] * 2, duration_s=[duration_s] * 2)


async def _served(p: Pipeline, job: str) -> dict[int, str]:
    async with p.ctx.db()() as session:
        return {r.rank: r.agent_id for r in await repo.job_ranks(session, job)}


async def _letters(p: Pipeline, n: int) -> list[DeadLetter]:
    async def enough() -> list[DeadLetter] | None:
        letters = await all_letters(p.ctx.js)
        return letters if len(letters) >= n else None
    letters: list[DeadLetter] = await p.wait(f"{n} dead letters", enough, 30)
    return letters


async def test_forged_telemetry_is_dead_lettered_and_nothing_is_recorded(
        own_bus: Bus, fresh_db_url: str, tmp_path: Path) -> None:
    job_a, job_b = f"a-{uuid.uuid4().hex[:6]}", f"b-{uuid.uuid4().hex[:6]}"
    async with pipeline(own_bus, fresh_db_url, tmp_path, services=("tracker",)) as p:
        real = StandInJob(p.bus, job_b)
        await real.start()
        await real.iterations(0, 4)
        owners = {r: a for a, ranks in AGENTS.items() for r in ranks}
        await p.wait("job B's ranks recorded", lambda: _wait_for(p, job_b, owners), 30)
        evil = await p.bus.connect(agent_user("evil"))
        js = evil.jetstream()
        await publish(js, Subjects.iterations(job_b, "evil"), _batch(job_b, "node-a", 30.0))
        await publish(js, Subjects.iterations(job_a, "evil"), _batch(job_b, "evil", 30.0))
        await publish(js, Subjects.hello(job_b, "evil"), AgentHello(
            job_id=job_b, agent_id="evil", host="evil", world_size=4,
            ranks=[RankInfo(rank=r, host="evil", pid=1, device=0) for r in range(4)]))
        letters = await _letters(p, 3)
        reasons = sorted(x.reason for x in letters)
        assert [r.split(":", 1)[0] for r in reasons] == [
            "handler_error", "subject_mismatch", "subject_mismatch"], reasons
        assert "the body's agent 'node-a' is not the subject's 'evil'" in reasons[2] + reasons[1]
        assert f"the body's job '{job_b}' is not the subject's '{job_a}'" in reasons[1] + reasons[2]
        assert "rank_taken" in reasons[0] and "0: node-a" in reasons[0]
        assert await _served(p, job_b) == owners  # the validator still pauses the real agents
        window = await read_window(p.ctx.js, job_b, window_s=3600, collectives=False)
        assert window.iterations and all(b.agent_id in AGENTS for b in window.iterations)
        assert max(d for b in window.iterations for d in b.duration_s) < 1.0  # not the 30 s

        # The job restarts on another node: its old agents announce nothing more, and the new
        # one takes the ranks once the takeover time (180 s) has passed since their last hello.
        await real.close()
        async with p.ctx.db()() as session:
            await session.execute(update(Rank).where(Rank.job_id == job_b).values(
                last_seen_at=datetime.now(UTC) - timedelta(seconds=TrackerSettings(
                ).tracker_rank_takeover_s + 10)))
            await session.commit()
        await publish(js, Subjects.hello(job_b, "evil"), AgentHello(
            job_id=job_b, agent_id="evil", host="evil", world_size=4,
            ranks=[RankInfo(rank=0, host="evil", pid=1, device=0)]))
        await p.wait("rank 0 taken over", lambda: _wait_for(p, job_b, {**owners, 0: "evil"}), 30)
        assert len(await all_letters(p.ctx.js)) == 3
        await evil.close()


async def _wait_for(p: Pipeline, job: str, want: dict[int, str]) -> bool:
    return await _served(p, job) == want
