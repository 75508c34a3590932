"""Webhooks to on-call (admin): create, list, delete, send a test, and read the delivery log."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query, Response

from services.api.auth import Admin
from services.api.deps import Session, SettingsDep, problems
from services.api.errors import Invalid, NotFound, Unavailable
from services.api.schemas import AttemptOut, DeliveryOut, WebhookCreated, WebhookIn, WebhookOut
from services.common.db import repository as repo
from services.common.settings import Settings
from services.common.webhooks.destination import DestinationRefused, check_literal, origin
from services.common.webhooks.payload import for_format, ping_payload
from services.common.webhooks.secretbox import SecretBox
from services.common.webhooks.sender import attempt
from services.common.webhooks.signing import new_secret

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])


def _box(settings: Settings) -> SecretBox:
    if settings.webhook_key is None:
        raise Unavailable("GREYHOUND_WEBHOOK_KEY is not set on the server: webhook secrets "
                          "cannot be stored encrypted, so no webhook can be created or sent")
    return SecretBox(settings.webhook_key.get_secret_value())


@router.post("", response_model=WebhookCreated, status_code=201,
             summary="Add a webhook; its signing secret is returned this once",
             description="422 for a URL whose host is an address webhooks may not reach "
                         "(loopback, link-local, private, ...: docs/webhooks.md) unless "
                         "GREYHOUND_WEBHOOK_ALLOW_HOSTS allows it; a host name is checked at "
                         "every send.",
             responses=problems(422, 503))
async def create_webhook(body: WebhookIn, session: Session, settings: SettingsDep,
                         who: Admin) -> WebhookCreated:
    box = _box(settings)
    try:
        check_literal(str(body.url), settings.webhook_allow())
    except DestinationRefused as exc:
        raise Invalid(f"url: {exc}") from None
    secret = body.secret or new_secret()
    hook = await repo.create_webhook(session, name=body.name, url=str(body.url),
                                     secret_enc=box.encrypt(secret), events=list(body.events),
                                     format=body.format, created_by=who.name)
    # the host only: a Slack webhook's path is its secret, and the audit log is no vault
    await repo.audit(session, actor=who.name, token_id=who.token_id, action="webhook.create",
                     target_type="webhook", target_id=hook.id,
                     detail={"url": origin(hook.url), "events": hook.events,
                             "format": hook.format})
    return WebhookCreated(**WebhookOut.model_validate(hook).model_dump(), secret=secret)


@router.get("", response_model=list[WebhookOut], summary="Every webhook (secrets never shown)")
async def list_webhooks(session: Session, _: Admin) -> list[WebhookOut]:
    return [WebhookOut.model_validate(h) for h in await repo.list_webhooks(session)]


@router.delete("/{webhook_id}", status_code=204, response_class=Response,
               summary="Delete a webhook and its delivery log", responses=problems(404))
async def delete_webhook(webhook_id: str, session: Session, who: Admin) -> Response:
    if not await repo.delete_webhook(session, webhook_id):
        raise NotFound(f"webhook {webhook_id!r} not found")
    await repo.audit(session, actor=who.name, token_id=who.token_id, action="webhook.delete",
                     target_type="webhook", target_id=webhook_id)
    return Response(status_code=204)


@router.post("/{webhook_id}/test", response_model=DeliveryOut,
             summary="Send a signed test event now and report what the receiver answered",
             description="One attempt, made by the API itself and logged like any delivery "
                         "(event webhook.test). A failure is reported, not retried.",
             responses=problems(404, 503))
async def send_test(webhook_id: str, session: Session, settings: SettingsDep,
                    who: Admin) -> DeliveryOut:
    hook = await repo.get_webhook(session, webhook_id)
    if hook is None:
        raise NotFound(f"webhook {webhook_id!r} not found")
    secret = _box(settings).decrypt(hook.secret_enc)
    now = datetime.now(UTC)
    key = f"test-{uuid.uuid4().hex}"
    payload = for_format(ping_payload(key, hook.name or hook.id, occurred_at=now), hook.format)
    delivery_id = await repo.enqueue_delivery(session, webhook_id=hook.id, event_id=key,
                                              event="webhook.test", incident_id=None,
                                              payload=payload, due=now)
    assert delivery_id is not None  # a fresh key
    body = json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()
    result = await attempt(hook.url, secret, body, key=key, event="webhook.test", number=1,
                           timeout_s=settings.webhook_timeout_s, allow=settings.webhook_allow())
    await repo.record_attempt(session, delivery_id, outcome=result.outcome,
                              status_code=result.status_code, error=result.error,
                              duration_ms=result.duration_ms,
                              final_status="delivered" if result.outcome == "delivered"
                              else "failed", next_attempt_at=None, at=datetime.now(UTC))
    await repo.audit(session, actor=who.name, token_id=who.token_id, action="webhook.test",
                     target_type="webhook", target_id=hook.id, detail={"outcome": result.outcome})
    await session.flush()  # what this unit wrote, read back as it will be committed
    session.expunge_all()
    return (await _deliveries(session, hook.id, limit=1, offset=0))[0]


async def _deliveries(session: Session, webhook_id: str, *, limit: int,
                      offset: int) -> list[DeliveryOut]:
    rows = await repo.list_deliveries(session, webhook_id, limit=limit, offset=offset)
    attempts = await repo.delivery_attempts(session, [d.id for d in rows])
    out = []
    for d in rows:
        item = DeliveryOut.model_validate(d)
        item.attempt_log = [AttemptOut.model_validate(a) for a in attempts if a.delivery_id == d.id]
        out.append(item)
    return out


@router.get("/{webhook_id}/deliveries", response_model=list[DeliveryOut],
            summary="A webhook's deliveries, newest first, each with its attempts",
            responses=problems(404, 422))
async def list_deliveries(webhook_id: str, session: Session, _: Admin,
                          limit: Annotated[int, Query(ge=1, le=500)] = 50,
                          offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0
                          ) -> list[DeliveryOut]:
    if await repo.get_webhook(session, webhook_id) is None:
        raise NotFound(f"webhook {webhook_id!r} not found")
    return await _deliveries(session, webhook_id, limit=limit, offset=offset)
