"""A job's timeline and heat map: pure on batches, then read back from JetStream by the API."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

from services.api.timeline import job_timeline, rank_states
from services.common.bus.auth import agent_user
from services.common.bus.client import publish
from services.common.bus.contract import CollectiveBatch, IterationBatch, Subjects
from tests.services.api.conftest import Api

NOW = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)


def _iters(ranks: int, start: datetime, durations: list[float],
           job: str = "j") -> IterationBatch:
    ends, t = [], start
    for d in durations:
        t += timedelta(seconds=d)
        ends.append(int(t.timestamp() * 1e9))
    return IterationBatch(job_id=job, agent_id="a", rank=[r for _ in ends for r in range(ranks)],
                          iteration=[i for i in range(len(ends)) for _ in range(ranks)],
                          end_ns=[e for e in ends for _ in range(ranks)],
                          duration_s=[d for d in durations for _ in range(ranks)])


def _colls(ranks: int, late_rank: int, at: datetime, job: str = "j",
           missing: int | None = None) -> CollectiveBatch:
    rows: dict[str, list[int]] = {c: [] for c in CollectiveBatch.COLUMNS}
    base = int(at.timestamp() * 1e9)
    for seq in range(5):
        for r in range(ranks):
            if r == missing and seq == 4:
                continue
            enter = base + seq * 10**9 + (200_000_000 if r == late_rank else 0)
            for c, v in (("rank", r), ("comm_id", 1), ("comm_rank", r), ("nranks", ranks),
                         ("seq", seq), ("op", 0), ("count", 1), ("dtype", 7), ("peer", -1),
                         ("enter_ns", enter), ("exit_ns", enter + 1), ("gpu_start_ns", 0),
                         ("gpu_end_ns", 0)):
                rows[c].append(v)
    return CollectiveBatch(job_id=job, agent_id="a", **rows)


def test_lateness_singles_out_the_late_rank() -> None:
    start = NOW - timedelta(seconds=60)
    tl = job_timeline([_iters(4, start, [1.0] * 30 + [1.5] * 20)],
                      [_colls(4, 2, NOW - timedelta(seconds=10), missing=1)],
                      since=start, until=NOW, buckets=6)
    assert tl.heat_basis == "lateness" and tl.ranks == [0, 1, 2, 3]
    last = [row[-1] for row in tl.heat]
    assert last[2] == 200.0 and last[0] == last[1] == last[3] == 0.0
    assert tl.median_s[0] == 1.0 and tl.median_s[-1] == 1.5


def test_slowdown_fallback_and_rank_states() -> None:
    start = NOW - timedelta(seconds=40)
    batch = _iters(2, start, [1.0] * 20 + [2.0] * 10)
    tl = job_timeline([batch], [], since=start, until=NOW, buckets=4)
    assert tl.heat_basis == "slowdown"
    assert tl.heat[0][0] == 1.0 and tl.heat[0][-1] == 2.0
    lagging = _iters(1, start, [1.0] * 5)
    lagging = lagging.model_copy(update={"rank": [1] * 5})
    states = {s.rank: s.state for s in rank_states([_iters(1, start, [1.0] * 38), lagging],
                                                   [0, 1, 2], now=NOW)}
    assert states == {0: "ok", 1: "stale", 2: "unknown"}


async def test_api_reads_the_window_from_jetstream(api: Api) -> None:
    job = f"tl-{int(time.time() * 1000)}"
    await api.job(job)
    now = datetime.now(UTC)
    assert api.bus is not None
    agent = await api.bus.connect(agent_user("a"))  # the job's agent publishes its telemetry
    await publish(agent.jetstream(), Subjects.iterations(job, "a"),
                  _iters(4, now - timedelta(seconds=50), [1.0] * 40 + [1.5] * 6, job=job))
    await publish(agent.jetstream(), Subjects.collectives(job, "a"),
                  _colls(4, 3, now - timedelta(seconds=6), job=job))
    await agent.close()
    r = await api.client.get(f"/v1/jobs/{job}/timeline", headers=api.auth("viewer"),
                             params={"window_s": 120, "buckets": 12})
    assert r.status_code == 200, r.text
    tl = r.json()
    assert tl["heat_basis"] == "lateness" and tl["truncated"] is False
    assert tl["telemetry_error"] is None and tl["ranks"] == [0, 1, 2, 3]
    late = [max(v for v in row if v is not None) for row in tl["heat"]]
    assert late.index(max(late)) == 3
    ranks = (await api.client.get(f"/v1/jobs/{job}/ranks", headers=api.auth("viewer"))).json()
    assert [(x["rank"], x["last_iteration"], x["last_iteration_s"]) for x in ranks] == [
        (r, 45, 1.5) for r in range(4)]
