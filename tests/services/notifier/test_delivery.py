"""Deliveries to a real receiver on loopback, from incident events on a real NATS server:
down and back (retried, delivered once), 5xx with back-off, refusals, idempotency keys,
signatures and replays."""

from __future__ import annotations

import itertools
import time
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from services.common.db import repository as repo
from services.common.db.models import WebhookAttempt, WebhookDelivery
from services.common.runtime import start_service
from services.common.webhooks.payload import SCHEMA
from services.common.webhooks.secretbox import SecretKeyError
from services.common.webhooks.signing import SignatureError, verify
from services.notifier.service import check_key
from tests.conftest import Bus
from tests.services.notifier.conftest import Running, notifier_settings, until
from tests.services.notifier.receiver import Receiver

SECRET = "whsec_notifier-test-secret"


async def _deliveries(r: Running) -> list[WebhookDelivery]:
    async with r.ctx.db()() as session:
        return list((await session.scalars(select(WebhookDelivery)
                                           .order_by(WebhookDelivery.id))).all())


async def _attempts(r: Running, delivery_id: int) -> list[WebhookAttempt]:
    async with r.ctx.db()() as session:
        return list((await session.scalars(select(WebhookAttempt).where(
            WebhookAttempt.delivery_id == delivery_id).order_by(WebhookAttempt.id))).all())


async def test_receiver_down_then_back_gets_it_once(running: Running) -> None:
    rx = Receiver(SECRET)  # not started: connection refused on its port
    await running.webhook(rx.url, SECRET)
    inc = await running.incident("job-down")
    await running.announce("job-down", inc)

    async def failed_twice() -> bool:
        rows = await _deliveries(running)
        return bool(rows) and rows[0].attempts >= 2

    await until(failed_twice, what="two failed attempts")
    await rx.start()
    try:
        async def delivered() -> bool:
            return (await _deliveries(running))[0].status == "delivered"

        await until(delivered, what="delivery after the receiver came back")
        # Every further detection of the open incident is announced again: no new page.
        await running.announce("job-down", inc)
        await running.announce("job-down", inc, stage="localized")
        await until(lambda: len(rx.processed) == 2, what="the localisation")
        (d, loc) = await _deliveries(running)
        assert d.event_id == f"{inc}.opened" and loc.event == "incident.localized"
        assert [p.key for p in rx.processed] == [d.event_id, loc.event_id]
        outcomes = [a.outcome for a in await _attempts(running, d.id)]
        assert outcomes[-1] == "delivered" and len(outcomes) >= 3
        assert set(outcomes[:-1]) == {"connection_error"}
        body: dict[str, Any] = rx.processed[0].body
        assert body["schema"] == SCHEMA and body["event"] == "incident.opened"
        assert body["id"] == d.event_id and body["incident"]["id"] == inc
        assert body["incident"]["url"].endswith(f"/#/incidents/{inc}")
        assert body["text"].startswith("[greyhound] incident opened")
        assert body["blocks"][0]["type"] == "section"
        assert body["incident"]["gpu_hours_lost"] > 0  # 8 GPUs, a third lost, since onset
    finally:
        await rx.stop()


async def test_server_errors_back_off_then_deliver(running: Running) -> None:
    rx = Receiver(SECRET, fail_next=3)
    await rx.start()
    try:
        await running.webhook(rx.url, SECRET, fmt="slack")
        inc = await running.incident("job-500")
        await running.announce("job-500", inc)
        await until(lambda: len(rx.processed) == 1, what="delivery after three 500s")

        async def recorded() -> bool:  # the attempt is logged after the receiver answered
            return (await _deliveries(running))[0].status == "delivered"

        await until(recorded, what="the delivered attempt to be logged")
        (d,) = await _deliveries(running)
        attempts = await _attempts(running, d.id)
        assert [(a.outcome, a.status_code) for a in attempts] == [
            ("http_error", 500)] * 3 + [("delivered", 200)]
        gaps = [(b.at - a.at).total_seconds() for a, b in itertools.pairwise(attempts)]
        # Jittered between half and all of 0.2, 0.4, 0.8 s: never sooner than the lower edge.
        for gap, floor in zip(gaps, (0.1, 0.2, 0.4), strict=True):
            assert gap >= floor * 0.95, gaps
        assert set(rx.processed[0].body) == {"text", "blocks"}  # slack format
        assert rx.requests == 4 and d.attempts == 4 and d.delivered_at is not None
    finally:
        await rx.stop()


async def test_a_timed_out_delivery_is_retried_and_processed_once(running: Running) -> None:
    """The first attempt's answer comes after the sender's 2 s timeout, but the receiver acts
    on it; the retry carries the same idempotency key and is acknowledged as a duplicate (or,
    if the retry overtakes the stalled request, the stalled one is)."""
    rx = Receiver(SECRET, stall_next_s=3.0)
    await rx.start()
    try:
        await running.webhook(rx.url, SECRET)
        inc = await running.incident("job-slow-rx")
        await running.announce("job-slow-rx", inc)

        async def settled() -> bool:
            rows = await _deliveries(running)
            return bool(rows) and rows[0].status == "delivered" and len(rx.duplicates) == 1

        await until(settled, what="the retry and the late answer")
        (d,) = await _deliveries(running)
        assert [a.outcome for a in await _attempts(running, d.id)] == ["timeout", "delivered"]
        assert [p.key for p in rx.processed] == [d.event_id] and rx.duplicates == [d.event_id]
    finally:
        await rx.stop()


async def test_signature_checked_and_replays_refused(running: Running) -> None:
    rx = Receiver(SECRET)
    await rx.start()
    try:
        await running.webhook(rx.url, SECRET)
        inc = await running.incident("job-sig")
        await running.announce("job-sig", inc)
        await until(lambda: len(rx.processed) == 1, what="the delivery")
        got = rx.processed[0]
        signed_at = verify(SECRET, got.headers["greyhound-signature"], got.raw)
        assert abs(signed_at - time.time()) < 60
        headers = {k: v for k, v in got.headers.items()
                   if k.startswith("greyhound-") or k == "content-type"}
        async with httpx.AsyncClient() as client:
            # The same request again (an attacker's replay, or our retry after a lost answer):
            # acknowledged, not processed a second time.
            r = await client.post(rx.url, content=got.raw, headers=headers)
            assert r.status_code == 200 and r.json()["duplicate"] is True
            # A body changed in flight does not match its signature.
            r = await client.post(rx.url, content=got.raw.replace(b"job-sig", b"job-evil"),
                                  headers=headers)
            assert r.status_code == 401
            # The capture under a new idempotency key, to pass the de-duplication as a new
            # event: the key is signed (v2), so it does not match either.
            r = await client.post(rx.url, content=got.raw,
                                  headers={**headers, "greyhound-delivery": "forged-key"})
            assert r.status_code == 401
        assert len(rx.processed) == 1 and rx.duplicates == [got.key]
        assert rx.rejected == ["signature does not match"] * 2
        # Replayed after the tolerance (the receiver may have forgotten the key by then).
        with pytest.raises(SignatureError, match="tolerance"):
            verify(SECRET, got.headers["greyhound-signature"], got.raw, now=signed_at + 301)
    finally:
        await rx.stop()


async def test_refusal_fails_at_once(running: Running) -> None:
    rx = Receiver("whsec_a-different-secret")
    await rx.start()
    try:
        await running.webhook(rx.url, SECRET, events=["incident.resolved"])
        inc = await running.incident("job-401")
        await running.announce("job-401", inc)  # not subscribed: no delivery
        await running.announce("job-401", inc, stage="resolved")

        async def failed() -> bool:
            rows = await _deliveries(running)
            return bool(rows) and rows[0].status == "failed"

        await until(failed, what="the refused delivery to fail")
        (d,) = await _deliveries(running)
        assert d.event == "incident.resolved" and d.attempts == 1
        assert "HTTP 401" in (d.last_error or "") and rx.processed == []
    finally:
        await rx.stop()


async def test_startup_refuses_webhooks_without_a_key(own_bus: Bus, fresh_db_url: str,
                                                      tmp_path: Any, running: Running) -> None:
    await running.webhook("http://127.0.0.1:9/x", SECRET)
    settings = notifier_settings(own_bus.url, fresh_db_url, tmp_path, webhook_key=None)
    ctx = await start_service("notifier", settings,
                              backends=own_bus.backends("notifier", fresh_db_url))
    try:
        with pytest.raises(SecretKeyError, match=r"1 webhook.*GREYHOUND_WEBHOOK_KEY is not set"):
            await check_key(ctx)
        async with ctx.db()() as session:
            assert await repo.count_webhooks(session) == 1
    finally:
        await ctx.close()
