"""On-call is paged for a slowdown that held, never for a suspicion: an incident only suspected
(a short transient could explain it) sends nothing while it is, a withdrawn one never does, and
a confirmed one sends ``incident.opened`` once, at its confirmation, then what it reached while
suspected (its localisation, held until then). Real NATS, Postgres and a receiver on loopback."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import select

from services.common.db import repository as repo
from services.common.db.models import WebhookDelivery
from services.common.webhooks.payload import pages
from tests.services.notifier.conftest import Running, until
from tests.services.notifier.receiver import Receiver

SECRET = "whsec_notifier-suspicion-secret"


async def _suspected(r: Running, job: str, *, confirmed: bool = False) -> str:
    """A slowdown incident the tracker suspected (and, with ``confirmed``, already confirmed)."""
    now = datetime.now(UTC)
    return await r.incident(job, suspected=repo.Moment(now, 12),
                            confirmed=repo.Moment(now, 14) if confirmed else None)


async def _confirm(r: Running, incident_id: str) -> None:
    async with r.ctx.db()() as session:
        inc = await repo.get_incident(session, incident_id)
        assert inc is not None
        repo.confirm_incident(inc, repo.Moment(datetime.now(UTC), 15))
        await session.commit()


async def _keys(r: Running, status: str = "delivered") -> list[str]:
    async with r.ctx.db()() as session:
        return list((await session.scalars(select(WebhookDelivery.event_id)
                                           .where(WebhookDelivery.status == status)
                                           .order_by(WebhookDelivery.id))).all())


async def test_only_a_confirmed_slowdown_pages(running: Running) -> None:
    rx = Receiver(SECRET)
    await rx.start()
    try:
        await running.webhook(rx.url, SECRET)
        # A suspicion: opened, profiled (localised while suspected), then withdrawn.
        gone = await _suspected(running, "job-transient")
        await running.announce("job-transient", gone)
        gone_localized = await running.announce("job-transient", gone, stage="localized")
        await running.announce("job-transient", gone, stage="resolved")
        # A suspicion that holds: nothing while suspected (its localisation held), opened once
        # confirmed, then the localisation.
        held = await _suspected(running, "job-held")
        await running.announce("job-held", held)
        localized = await running.announce("job-held", held, stage="localized")
        # A slowdown confirmed at once pages at once; the consumer handles events in order, so
        # once its page is delivered every event above has been handled.
        at_once = await _suspected(running, "job-at-once", confirmed=True)
        await running.announce("job-at-once", at_once)
        await until(lambda: len(rx.processed) == 1, what="the confirmed slowdown's page")
        assert [p.key for p in rx.processed] == [f"{at_once}.opened"]
        assert await _keys(running) == [f"{at_once}.opened"]
        assert await _keys(running, "held") == [localized.event_id]
        assert await _keys(running, "withdrawn") == [gone_localized.event_id]

        await _confirm(running, held)
        await running.announce("job-held", held)  # the analyzer's event for the confirmation
        await until(lambda: len(rx.processed) == 3, what="the confirmation's pages")
        assert [p.key for p in rx.processed][1:] == [f"{held}.opened", localized.event_id]
        assert [p.body["event"] for p in rx.processed][1:] == ["incident.opened",
                                                               "incident.localized"]
        # a localisation after the confirmation is sent as it comes; the held one once only
        await running.announce("job-held", held)
        again = await running.announce("job-held", held, stage="localized")
        await until(lambda: len(rx.processed) == 4, what="the later localisation")
        assert rx.processed[3].key == again.event_id
        assert not any(gone in k for k in await _keys(running))
        assert await _keys(running, "held") == []
    finally:
        await rx.stop()


def test_pages_reads_the_stage() -> None:
    class Inc:
        def __init__(self, only_suspected: bool) -> None:
            self.only_suspected = only_suspected

    assert not pages(Inc(True)) and pages(Inc(False))
