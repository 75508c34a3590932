"""Webhooks over REST: the secret is shown once and stored encrypted, a test send is signed
and logged, and deletion and a missing key answer clearly."""

from __future__ import annotations

from pathlib import Path

import httpx
from sqlalchemy import select

from services.api.app import create_app
from services.api.settings import ApiSettings
from services.common.db.models import Webhook
from services.common.webhooks.secretbox import SecretBox
from services.common.webhooks.signing import verify
from tests.conftest import Bus
from tests.services.api.conftest import WEBHOOK_KEY, Api, api_settings
from tests.services.notifier.receiver import Receiver


async def test_create_list_test_send_and_delete(api: Api) -> None:
    admin = api.auth("admin")
    secret = "whsec_known-secret-for-this-test"
    rx = Receiver(secret)
    await rx.start()
    try:
        r = await api.client.post("/v1/webhooks", headers=admin, json={
            "name": "oncall", "url": rx.url, "secret": secret, "format": "slack",
            "events": ["incident.opened", "incident.resolved"]})
        assert r.status_code == 201, r.text
        made = r.json()
        assert made["secret"] == secret and made["format"] == "slack"
        async with api.ctx.db()() as session:
            row = (await session.scalars(select(Webhook))).one()
        assert secret not in row.secret_enc and SecretBox(WEBHOOK_KEY).decrypt(row.secret_enc) \
            == secret
        listed = (await api.client.get("/v1/webhooks", headers=admin)).json()
        assert [h["id"] for h in listed] == [made["id"]] and "secret" not in listed[0]

        r = await api.client.post(f"/v1/webhooks/{made['id']}/test", headers=admin)
        assert r.status_code == 200, r.text
        sent = r.json()
        assert sent["status"] == "delivered" and sent["attempts"] == 1
        assert [a["outcome"] for a in sent["attempt_log"]] == ["delivered"]
        (got,) = rx.processed
        assert got.key == sent["event_id"] and set(got.body) == {"text", "blocks"}
        verify(secret, got.headers["greyhound-signature"], got.raw, delivery=got.key)

        log = (await api.client.get(f"/v1/webhooks/{made['id']}/deliveries",
                                    headers=admin)).json()
        assert [d["event"] for d in log] == ["webhook.test"]
        assert (await api.client.delete(f"/v1/webhooks/{made['id']}",
                                        headers=admin)).status_code == 204
        assert (await api.client.delete(f"/v1/webhooks/{made['id']}",
                                        headers=admin)).status_code == 404
    finally:
        await rx.stop()


async def test_a_failing_test_send_is_reported(api: Api) -> None:
    made = (await api.client.post("/v1/webhooks", headers=api.auth("admin"),
                                  json={"url": "http://127.0.0.1:9/down"})).json()
    assert made["secret"].startswith("whsec_") and made["events"] == []
    r = await api.client.post(f"/v1/webhooks/{made['id']}/test", headers=api.auth("admin"))
    body = r.json()
    assert body["status"] == "failed"
    assert body["attempt_log"][0]["outcome"] == "connection_error"


async def test_bad_input_and_missing_key(api: Api, bus: Bus, fresh_db_url: str,
                                         tmp_path: Path) -> None:
    admin = api.auth("admin")
    for bad in ({"url": "not a url"}, {"url": "http://x.test/", "events": ["nope"]},
                {"url": "http://x.test/", "format": "xml"}, {"url": "http://x.test/", "extra": 1}):
        r = await api.client.post("/v1/webhooks", headers=admin, json=bad)
        assert r.status_code == 422, bad
    keyless = create_app(api.ctx.db(), settings=api_settings(bus.url, fresh_db_url, tmp_path,
                                                             webhook_key=None),
                         api=ApiSettings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=keyless),
                                 base_url="http://a") as c:
        r = await c.post("/v1/webhooks", headers=admin, json={"url": "http://x.test/"})
    assert r.status_code == 503 and "GREYHOUND_WEBHOOK_KEY" in r.json()["detail"]


async def test_webhooks_to_internal_addresses_are_refused(api: Api, bus: Bus, fresh_db_url: str,
                                                          tmp_path: Path) -> None:
    """Without GREYHOUND_WEBHOOK_ALLOW_HOSTS: a URL naming loopback or the metadata address is
    a 422; one stored before the check (or a name that resolves there) is refused at the test
    send, before anything connects; the audit log keeps the URL's origin, not its secret path."""
    secret = "whsec_known-secret-for-this-test"
    rx = Receiver(secret)
    await rx.start()
    strict = create_app(api.ctx.db(), settings=api_settings(bus.url, fresh_db_url, tmp_path,
                                                            webhook_allow_hosts=""),
                        api=ApiSettings())
    admin = api.auth("admin")
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=strict),
                                     base_url="http://a") as c:
            for url in (rx.url, "http://169.254.169.254/latest/meta-data/iam/",
                        "http://[::ffff:169.254.169.254]/", f"http://localhost:{rx.port}/"):
                r = await c.post("/v1/webhooks", headers=admin, json={"url": url})
                assert r.status_code == 422 and "GREYHOUND_WEBHOOK_ALLOW_HOSTS" in r.text, url
            async with api.ctx.db()() as session:
                hook = Webhook(url=rx.url, secret_enc=SecretBox(WEBHOOK_KEY).encrypt(secret),
                               events=[], name="old")
                session.add(hook)
                await session.commit()
            r = await c.post(f"/v1/webhooks/{hook.id}/test", headers=admin)
            assert r.status_code == 200, r.text
            (tried,) = r.json()["attempt_log"]
            assert tried["outcome"] == "rejected" and "destination refused" in tried["error"]
            assert rx.requests == 0
            made = await c.post("/v1/webhooks", headers=admin, json={
                "url": "https://hooks.slack.com/services/T000/B000/SECRETPATH"})
            assert made.status_code == 201, made.text
        audit = (await api.client.get("/v1/audit", headers=admin,
                                      params={"target_type": "webhook"})).json()
        assert audit[0]["detail"]["url"] == "https://hooks.slack.com"
        assert "SECRETPATH" not in str(audit)
    finally:
        await rx.stop()
