"""Transient failures on the real nats-server and Postgres: retried however long the database is
away (fetching pauses until it answers), handled once it is back; dead-lettered only when they
recur while the database answers."""

from __future__ import annotations

import asyncio
import uuid

import sqlalchemy.exc as sa
from sqlalchemy import text

from services.common.bus.client import Consumer, TransientError
from services.common.bus.contract import IterationBatch, Subjects
from services.common.bus.streams import TELEMETRY, ConsumerSpec
from services.common.db.session import make_engine, make_sessionmaker
from services.common.unit_of_work import Work
from tests.conftest import Bus
from tests.services.common.pg_proxy import PgProxy
from tests.services.common.support import batch, jetstream, letters_for, until

# The outage, over twenty times the bound that used to lose a message: three deliveries 0.1 s
# apart. The consumer now asks the database, not the clock, so nothing depends on the outage's
# length beyond that bound (with the services' own delays, 1, 5, 15, 30 s, it was about a
# minute) except how often the database is asked: every 0.5, 1, 2, 4 s here.
OUTAGE_S = 6.0


async def test_database_outage_is_retried_then_handled_once(bus: Bus, fresh_db_url: str) -> None:
    job = f"pgdown{uuid.uuid4().hex[:8]}"
    subject = Subjects.iterations(job, "a1")
    nc, js = await jetstream(bus, "test-pgdown")
    proxy = PgProxy(fresh_db_url)
    await proxy.start()
    engine = make_engine(proxy.url)
    direct = make_engine(fresh_db_url)
    sessions = make_sessionmaker(engine)
    async with direct.begin() as conn:
        await conn.execute(text("create table seen (event_id text primary key, iteration int)"))
    in_transaction, resume = asyncio.Event(), asyncio.Event()
    failures: list[BaseException] = []

    async def handler(_subject: str, msg: IterationBatch) -> None:
        try:
            async with sessions() as session:
                await session.execute(text("insert into seen values (:e, :i)"),
                                      {"e": msg.event_id, "i": msg.iteration[0]})
                if not in_transaction.is_set():
                    in_transaction.set()
                    await resume.wait()  # the database goes away under this open transaction
                await session.commit()
        except Exception as exc:
            failures.append(exc)
            raise

    spec = ConsumerSpec(stream=TELEMETRY, durable=f"pgdown-{job}", filter_subjects=(subject,),
                        max_deliver=3, retry_delays_s=(0.1,))
    consumer: Consumer[IterationBatch] = Consumer(js, spec, IterationBatch, handler,
                                                  ready=Work(sessions).writable)
    runner = asyncio.create_task(consumer.run())
    try:
        sent = batch(job, 7)
        await js.publish(subject, sent.model_dump_json().encode())
        await asyncio.wait_for(in_transaction.wait(), 20)
        await proxy.stop()
        resume.set()
        await until(lambda: consumer.stats.paused == 1, what="fetching paused")
        later = [batch(job, 8)]
        await js.publish(subject, later[0].model_dump_json().encode())
        await asyncio.sleep(OUTAGE_S)
        assert consumer.stats.handled == 0 and consumer.stats.dead_lettered == 0
        # The commit under the cut connection fails with SQLAlchemy's DBAPIError, no OSError:
        # the handlers' old `except OSError` dead-lettered exactly this.
        assert isinstance(failures[0], sa.DBAPIError) and not isinstance(failures[0], OSError)
        assert len(failures) == 1  # paused: nothing fetched, so nothing else failed

        await proxy.start()
        await until(lambda: consumer.stats.handled == 2, timeout_s=60,
                    what="handled once the database is back")
        assert consumer.stats.paused_s >= OUTAGE_S
        assert not runner.done()
    finally:
        consumer.stop()
        await asyncio.wait_for(runner, 20)
        await engine.dispose()
    async with direct.connect() as conn:
        rows = (await conn.execute(text("select event_id, iteration from seen"))).all()
    await direct.dispose()
    assert rows == [(sent.event_id, 7), (later[0].event_id, 8)]
    assert consumer.stats.dead_lettered == 0
    assert await letters_for(js, TELEMETRY, subject) == []
    await nc.drain()


async def test_transient_failures_reach_the_dlq_when_they_recur_while_it_answers(bus: Bus) -> None:
    job = f"exhaust{uuid.uuid4().hex[:8]}"
    subject = Subjects.iterations(job, "a1")
    nc, js = await jetstream(bus, "test-exhaust")
    calls: list[int] = []

    async def handler(_subject: str, msg: IterationBatch) -> None:
        calls.append(msg.iteration[0])
        raise TransientError("dependency busy")

    spec = ConsumerSpec(stream=TELEMETRY, durable=f"exhaust-{job}", filter_subjects=(subject,),
                        max_deliver=3, retry_delays_s=(0.1,))
    consumer: Consumer[IterationBatch] = Consumer(js, spec, IterationBatch, handler)
    runner = asyncio.create_task(consumer.run())
    sent = batch(job, 3)
    try:
        await js.publish(subject, sent.model_dump_json().encode())
        await until(lambda: consumer.stats.dead_lettered == 1, what="the dead letter")
        await asyncio.sleep(1.0)  # ten retry delays: nothing more may arrive
        assert calls == [3, 3, 3]
        assert consumer.stats.retried == 2
        assert consumer.stats.reasons == {"retries_exhausted": 1}
        info = await js.consumer_info(TELEMETRY, spec.durable)
        assert info.num_ack_pending == 0 and info.num_pending == 0
    finally:
        consumer.stop()
        await asyncio.wait_for(runner, 20)
    [letter] = await letters_for(js, TELEMETRY, subject)
    assert letter.reason.startswith(
        "retries_exhausted: 3 tries of 3 while its dependencies answered: "
        "TransientError")
    assert letter.consumer == spec.durable and letter.payload_cut_bytes == 0
    assert IterationBatch.model_validate_json(letter.payload) == sent
    await nc.drain()
