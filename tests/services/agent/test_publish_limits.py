"""A batch over the server's max_payload is split and delivered whole, never retried forever: at
256 simulated ranks one profile-mode batch of collectives was over NATS's 1 MB default and
blocked every later message of the agent."""

from __future__ import annotations

import uuid

from services.agent.service import NodeAgent
from services.agent.settings import AgentSettings
from services.common.bus.auth import agent_user
from services.common.bus.client import ensure_streams
from services.common.bus.contract import CollectiveBatch, Subjects, split_columns
from services.common.settings import Settings
from tests.conftest import Bus

ROWS = 30_000  # ~3.5 MB of JSON


def big_batch(job: str) -> CollectiveBatch:
    cols = {c: [10**18 + i for i in range(ROWS)] for c in CollectiveBatch.COLUMNS}
    cols["rank"] = list(range(ROWS))
    for small in ("comm_rank", "nranks", "peer", "op", "dtype"):  # within the contract's bounds
        cols[small] = [i % 8 for i in range(ROWS)]
    return CollectiveBatch(job_id=job, agent_id="lim", **cols)


def test_split_columns_halves_every_column_with_new_ids() -> None:
    b = big_batch("j")
    halves = split_columns(b)
    assert halves is not None
    lo, hi = halves
    assert isinstance(lo, CollectiveBatch) and isinstance(hi, CollectiveBatch)
    assert lo.rank + hi.rank == b.rank and lo.exit_ns + hi.exit_ns == b.exit_ns
    assert len({b.event_id, lo.event_id, hi.event_id}) == 3
    one = CollectiveBatch(job_id="j", agent_id="lim", **{c: [1] for c in CollectiveBatch.COLUMNS})
    assert split_columns(one) is None


async def test_oversized_batch_is_split_and_later_messages_still_flow(bus: Bus) -> None:
    settings = Settings(nats_url=bus.url)
    nc = await bus.connect(agent_user("lim"))
    watch = await bus.connect()  # the operator reads what the agent stored
    try:
        js = watch.jetstream()
        await ensure_streams(js, settings)
        job = f"lim{uuid.uuid4().hex[:6]}"
        assert len(big_batch(job).model_dump_json()) > nc.max_payload
        agent = NodeAgent(settings.shm_dir, nc.jetstream(), agent_id="lim", jobs=[],
                          settings=AgentSettings())
        subject = Subjects.collectives(job, "lim")
        agent.backlog.append((subject, big_batch(job)))
        small = CollectiveBatch(job_id=job, agent_id="lim",
                                **{c: [7] for c in CollectiveBatch.COLUMNS})
        agent.backlog.append((subject, small))
        await agent.flush()
        assert not agent.backlog and agent.dropped == 0
        sub = await js.subscribe(subject, ordered_consumer=True)
        got: list[int] = []
        while len(got) < ROWS + 1:
            msg = await sub.next_msg(timeout=10)
            got += CollectiveBatch.model_validate_json(msg.data).rank
        assert got == [*range(ROWS), 7]  # everything, in order
        assert agent.published > 2
    finally:
        await nc.close()
        await watch.close()
