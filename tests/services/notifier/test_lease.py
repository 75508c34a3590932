"""Two notifiers and one delivery: what a sender writes after its send is written only while it
still holds the delivery's lease."""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import select

from services.common.db import repository as repo
from services.common.db.models import WebhookAttempt, WebhookDelivery
from services.common.runtime import ServiceContext, start_service
from services.common.webhooks.secretbox import SecretBox
from services.notifier.service import Notifier
from tests.conftest import Bus
from tests.services.notifier.conftest import FAST, KEY, notifier_settings
from tests.services.notifier.receiver import Receiver

SECRET = "whsec_notifier-lease-secret"


async def _due(ctx: ServiceContext, box: SecretBox, url: str, key: str) -> int:
    """A webhook to ``url`` and one delivery of it, due now; the delivery's id."""
    async with ctx.db()() as session:
        hook = await repo.create_webhook(session, name="oncall", url=url,
                                         secret_enc=box.encrypt(SECRET), events=[],
                                         format="json", created_by="test")
        delivery = await repo.enqueue_delivery(
            session, webhook_id=hook.id, event_id=key, event="incident.detected",
            incident_id=None, payload={"text": "x"}, due=datetime.now(UTC))
        await session.commit()
    assert delivery is not None
    return delivery


async def test_a_late_sender_cannot_overwrite_the_new_lease_holders_result(
        own_bus: Bus, fresh_db_url: str, tmp_path: Path) -> None:
    """Notifier A's send outlives its lease (a lease shorter than the send's deadline stands
    for a process that stalled); B claims the delivery once that lease has ended and delivers
    it; A's timeout, coming after, is not recorded: the delivery stays delivered, with B's
    one attempt, and nobody sends it again."""
    settings = notifier_settings(own_bus.url, fresh_db_url, tmp_path)  # a 2 s send deadline
    ctx = await start_service("notifier", settings,
                              backends=own_bus.backends("notifier", fresh_db_url))
    box = SecretBox(KEY)
    late = Notifier(ctx, box, FAST, rng=random.Random(1), lease_margin_s=-1.5)  # a 0.5 s lease
    holder = Notifier(ctx, box, FAST, rng=random.Random(2))
    rx = Receiver(SECRET, stall_next_s=4.0)  # A's request answered after A's deadline
    await rx.start()
    try:
        delivery = await _due(ctx, box, rx.url, "lease-key")
        a = asyncio.create_task(late.send_due())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30.0
        while rx.requests < 1 and loop.time() < deadline:  # A is sending
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.6)  # A's lease has ended; its send has not
        assert await holder.send_due() == 1  # B takes the delivery over and delivers it
        assert holder.stats.delivered == 1
        assert await asyncio.wait_for(a, 30.0) == 1  # A's send timed out, after B's
        assert late.stats.lease_lost == 1 and late.stats.retried == 0

        async with ctx.db()() as session:
            d = (await session.scalars(select(WebhookDelivery)
                                       .where(WebhookDelivery.id == delivery))).one()
            attempts = (await session.scalars(select(WebhookAttempt).where(
                WebhookAttempt.delivery_id == delivery))).all()
        assert d.status == "delivered" and d.attempts == 1 and d.next_attempt_at is None
        assert [x.outcome for x in attempts] == ["delivered"]
        assert await holder.send_due() == 0 and await late.send_due() == 0  # nothing is due
        assert [p.key for p in rx.processed] == ["lease-key"]
    finally:
        await rx.stop()
        await ctx.close()


async def test_a_sender_within_its_lease_records_its_attempt(
        own_bus: Bus, fresh_db_url: str, tmp_path: Path) -> None:
    """The usual case: the claimer still holds the lease when it writes, so a failure is
    recorded and the delivery is due again after its back-off, not after a lease."""
    settings = notifier_settings(own_bus.url, fresh_db_url, tmp_path)
    ctx = await start_service("notifier", settings,
                              backends=own_bus.backends("notifier", fresh_db_url))
    box = SecretBox(KEY)
    sender = Notifier(ctx, box, FAST, rng=random.Random(3))
    rx = Receiver(SECRET, fail_next=1)
    await rx.start()
    try:
        delivery = await _due(ctx, box, rx.url, "held-key")
        assert await sender.send_due() == 1
        async with ctx.db()() as session:
            d = (await session.scalars(select(WebhookDelivery)
                                       .where(WebhookDelivery.id == delivery))).one()
        assert d.status == "pending" and d.attempts == 1 and sender.stats.lease_lost == 0
        assert d.next_attempt_at is not None
        assert (d.next_attempt_at - datetime.now(UTC)).total_seconds() < 5.0  # FAST back-off
    finally:
        await rx.stop()
        await ctx.close()
