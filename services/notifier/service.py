"""Notifier: incident events in, signed webhook deliveries out.

Two loops. The consumer (durable ``notifier`` on the events stream) turns each incident event
into one pending delivery per interested webhook, with the body frozen and an idempotency key,
commits, then acks: a crash before the commit redelivers the event, a crash after it finds the
rows already there (unique per webhook and key). The sender claims due deliveries (leased with
SKIP LOCKED, so replicas share the work), signs and posts them, and logs every attempt; a
failure is retried with exponential back-off and jitter until ``webhook_max_attempts``
(services.notifier.settings).

A send has one deadline, ``webhook_timeout_s``, for everything (resolving, connecting, TLS,
sending, the reply's status line; services.common.webhooks.sender), and its lease lasts
``lease_margin_s`` longer, so another notifier sends a delivery again only when its sender
died or stalled. What the sender writes after a send is written only while it still holds
that lease (repository.record_leased_attempt): once another notifier has claimed the delivery,
the late result is logged and dropped, never written over the new holder's.

On-call is paged only for a slowdown that held (or a hang): an incident only suspected so far
(greyhound.core.levels; a short transient could explain it) sends nothing, whatever its stage.
Its confirmation is announced again as ``detected`` and sends ``incident.opened`` then, with
what the incident knows by that time; a suspicion withdrawn before it held never pages anyone,
not even with its resolution. A stage the suspicion reached meanwhile (its localisation) is
frozen as it happened and *held*: the confirmation releases it a moment after the opening, a
withdrawal marks it ``withdrawn``. So a slowdown that held sends the same events whatever raced
(localised before or after its confirmation, an event handled late by a twin), each once.

Each event is handled with its incident's row locked (repository.get_incident_for_update), so
the two that race, a stage held while suspected and the confirmation releasing what is held,
see each other's work: whichever runs second reads what the first committed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from services.common.bus.client import Consumer
from services.common.bus.contract import IncidentEvent, Subjects
from services.common.bus.streams import EVENTS, ConsumerSpec
from services.common.db import repository as repo
from services.common.db.models import Webhook, WebhookDelivery
from services.common.runtime import ServiceContext
from services.common.settings import Settings
from services.common.unit_of_work import UnitOfWork, Work
from services.common.webhooks.enqueue import enqueue, incident_facts
from services.common.webhooks.payload import STAGE_EVENT, delivery_key, incident_payload, pages
from services.common.webhooks.secretbox import SecretBox, SecretKeyError
from services.common.webhooks.sender import Attempt, attempt, retry_delay_s
from services.notifier.settings import NotifierSettings

log = logging.getLogger(__name__)

RELEASE_AFTER_OPENED_S = 1.0  # a held stage is sent this long after the opening it follows

NOTIFIER = ConsumerSpec(stream=EVENTS, durable="notifier",
                        filter_subjects=(Subjects.ALL_INCIDENTS,), batch=64)


@dataclass
class SenderStats:
    delivered: int = 0
    failed: int = 0
    retried: int = 0
    attempts: int = 0
    lease_lost: int = 0  # attempts whose result came after another notifier claimed them


@dataclass
class Notifier:
    ctx: ServiceContext
    box: SecretBox | None
    config: NotifierSettings
    rng: random.Random = field(default_factory=random.Random)
    stats: SenderStats = field(default_factory=SenderStats)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    lease_margin_s: float = 30.0

    @property
    def settings(self) -> Settings:
        return self.ctx.settings

    # ---- bus events -> pending deliveries ---------------------------------------------------

    def __post_init__(self) -> None:
        self.work = Work(self.ctx.db())  # it announces nothing on the bus: no outbox

    async def consume(self, subject: str, ev: IncidentEvent) -> None:
        """What the consumer calls: ``handle`` in a unit of work of its own, each event
        claimed in the processed-events ledger."""
        await self.work.per_message(self.handle, claim=NOTIFIER.durable)(subject, ev)

    async def handle(self, uow: UnitOfWork, subject: str, ev: IncidentEvent) -> None:
        """The event's deliveries, one per webhook that wants it, frozen in this unit; the
        sender is woken once they are committed."""
        event = STAGE_EVENT[ev.stage]
        inc = await repo.get_incident_for_update(uow.session, ev.incident_id, timeline=True)
        if inc is None:
            log.warning("incident event %s names unknown incident %s", ev.event_id,
                        ev.incident_id)
            return
        held = not pages(inc)
        if held and event == "incident.resolved":
            n = await repo.withdraw_held_deliveries(uow.session, inc.id)
            log.info("incident %s withdrawn while only suspected: nothing sent (%d held "
                     "deliveries withdrawn)", inc.id, n)
            return
        if held and event == "incident.opened":
            log.info("incident %s only suspected: not announced (on-call hears of it once the "
                     "tracker confirms it)", inc.id)
            return
        now = datetime.now(UTC)
        facts = await incident_facts(uow.session, inc, now)
        key = delivery_key(event, inc.id, ev.event_id)
        body = incident_payload(event, key, facts, occurred_at=datetime.fromtimestamp(ev.ts, UTC),
                                dashboard=self.settings.api_public_url)
        made = await enqueue(uow.session, event=event, key=key, payload=body, incident_id=inc.id,
                             now=now, held=held)
        if held:
            log.info("incident %s only suspected: %s held until the tracker confirms it",
                     inc.id, event)
            return
        if event == "incident.opened":
            made += await repo.release_held_deliveries(
                uow.session, inc.id, now + timedelta(seconds=RELEASE_AFTER_OPENED_S))
        if made:
            uow.after_commit(self._wake)

    async def _wake(self) -> None:
        self.wake.set()

    # ---- pending deliveries -> HTTP -----------------------------------------------------------

    async def send_due(self, limit: int = 32) -> int:
        """Claim and send what is due now; how many attempts were made."""
        s = self.settings
        now = datetime.now(UTC)
        lease = now + timedelta(seconds=s.webhook_timeout_s + self.lease_margin_s)
        async with self.work.unit() as uow:
            due = list(await repo.claim_due_deliveries(uow.session, now, lease, limit))
            hooks = {h.id: h for h in await repo.list_webhooks(uow.session)}
        if not due:
            return 0
        await asyncio.gather(*(self._send_one(d, hooks.get(d.webhook_id), lease) for d in due))
        return len(due)

    async def _send_one(self, d: WebhookDelivery, hook: Webhook | None,
                        lease: datetime) -> None:
        s = self.settings
        number = d.attempts + 1
        if hook is None or not hook.enabled:
            result = Attempt("rejected", None, "webhook deleted or disabled", 0.0)
        elif self.box is None:
            result = Attempt("rejected", None, "GREYHOUND_WEBHOOK_KEY is not set", 0.0)
        else:
            try:
                secret = self.box.decrypt(hook.secret_enc)
            except SecretKeyError as exc:
                result = Attempt("rejected", None, str(exc), 0.0)
            else:
                body = json.dumps(d.payload, separators=(",", ":"), sort_keys=True).encode()
                result = await attempt(hook.url, secret, body, key=d.event_id, event=d.event,
                                       number=number, timeout_s=s.webhook_timeout_s,
                                       allow=s.webhook_allow())
        await self._record(d, number, result, lease)

    async def _record(self, d: WebhookDelivery, number: int, result: Attempt,
                      lease: datetime) -> None:
        c = self.config
        now = datetime.now(UTC)
        self.stats.attempts += 1
        next_at: datetime | None = None
        if result.outcome == "delivered":
            status = "delivered"
        elif result.retryable and number < c.webhook_max_attempts:
            status = "pending"
            delay = retry_delay_s(number, base_s=c.webhook_backoff_base_s,
                                  max_s=c.webhook_backoff_max_s, rng=self.rng,
                                  retry_after_s=result.retry_after_s)
            next_at = now + timedelta(seconds=delay)
        else:
            status = "failed"
        async with self.work.unit() as uow:
            held = await repo.record_leased_attempt(
                uow.session, d.id, lease_until=lease, outcome=result.outcome,
                status_code=result.status_code, error=result.error,
                duration_ms=result.duration_ms, final_status=status, next_attempt_at=next_at,
                at=now)
        if not held:
            self.stats.lease_lost += 1
            log.warning("delivery %s (%s) attempt %d: %s, not recorded: its lease ended and "
                        "another notifier holds it now", d.event_id, d.event, number,
                        result.outcome)
            return
        if status == "delivered":
            self.stats.delivered += 1
        elif status == "pending":
            self.stats.retried += 1
        else:
            self.stats.failed += 1
        level = logging.INFO if status != "failed" else logging.WARNING
        log.log(level, "delivery %s (%s) attempt %d: %s%s", d.event_id, d.event, number,
                result.outcome, f" ({result.error})" if result.error else "")

    async def run_sender(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                sent = await self.send_due()
            except Exception:  # the database restarting must not end the loop
                log.exception("webhook sender pass failed")
                sent = 0
            if sent:
                continue
            self.wake.clear()
            waits = [asyncio.create_task(self.wake.wait()), asyncio.create_task(stop.wait())]
            await asyncio.wait(waits, timeout=self.config.notifier_poll_s,
                               return_when=asyncio.FIRST_COMPLETED)
            for t in waits:
                t.cancel()


async def check_key(ctx: ServiceContext) -> SecretBox | None:
    """A clear error at start-up when webhooks exist and there is no key to read their secrets."""
    key = ctx.settings.webhook_key
    async with Work(ctx.db()).read() as session:
        hooks = await repo.count_webhooks(session)
    if key is None:
        if hooks:
            raise SecretKeyError(
                f"{hooks} webhook(s) are configured but GREYHOUND_WEBHOOK_KEY is not set: set it "
                "to the key their secrets were encrypted with")
        log.warning("GREYHOUND_WEBHOOK_KEY is not set: no webhook can be created or sent")
        return None
    return SecretBox(key.get_secret_value())


async def run_notifier(ctx: ServiceContext, stop: asyncio.Event, *,
                       notifier: Notifier | None = None,
                       settings: NotifierSettings | None = None) -> None:
    """``settings`` (read from the environment when not given) apply to the notifier made here;
    a ``notifier`` passed in brings its own."""
    notifier = notifier or Notifier(ctx, await check_key(ctx), settings or NotifierSettings())
    consumer: Consumer[IncidentEvent] = Consumer(ctx.js, NOTIFIER, IncidentEvent, notifier.consume,
                                                 ready=notifier.work.writable)
    tasks = [asyncio.create_task(consumer.run()), asyncio.create_task(notifier.run_sender(stop))]
    await stop.wait()
    consumer.stop()
    await asyncio.gather(*tasks)
