"""Signatures, the receiver's replay guard, back-off and the webhook body, on their own."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest

from services.common.db.documents import Culprit, Gpu
from services.common.webhooks.payload import (
    SCHEMA,
    IncidentFacts,
    delivery_key,
    for_format,
    incident_payload,
    wants,
)
from services.common.webhooks.secretbox import SecretBox, SecretKeyError
from services.common.webhooks.sender import retry_delay_s
from services.common.webhooks.signing import ReplayGuard, SignatureError, sign, verify

SECRET = "whsec_test"


def test_signature_binds_time_body_and_delivery_key() -> None:
    header = sign(SECRET, 1_800_000_000, b'{"a":1}', "k1")
    assert verify(SECRET, header, b'{"a":1}', delivery="k1", now=1_800_000_100) == 1_800_000_000
    assert verify(SECRET, header, b'{"a":1}', now=1_800_000_100) == 1_800_000_000  # v1 alone
    # a capture replayed under another idempotency key: a receiver checking v2 refuses it
    with pytest.raises(SignatureError, match="does not match"):
        verify(SECRET, header, b'{"a":1}', delivery="k2", now=1_800_000_100)
    with pytest.raises(SignatureError, match="malformed"):  # no v2: a receiver needing it
        verify(SECRET, header.split(",v2=")[0], b'{"a":1}', delivery="k1", now=1_800_000_100)
    for bad_body, secret, now in ((b'{"a":2}', SECRET, 1_800_000_000),
                                  (b'{"a":1}', "whsec_other", 1_800_000_000),
                                  (b'{"a":1}', SECRET, 1_800_000_301)):
        with pytest.raises(SignatureError):
            verify(secret, header, bad_body, now=now)
    forged = header.replace("t=1800000000", "t=1800000500")  # a newer time, the old MAC
    with pytest.raises(SignatureError, match="does not match"):
        verify(SECRET, forged, b'{"a":1}', now=1_800_000_500)
    with pytest.raises(SignatureError, match="malformed"):
        verify(SECRET, "v1=abc", b"", now=0)


def test_replay_guard_remembers_within_the_window() -> None:
    g = ReplayGuard(tolerance_s=300)
    assert g.first_time("k1", now=1000) and not g.first_time("k1", now=1100)
    assert g.first_time("k1", now=1000 + 700)  # long gone: verify() refuses such a request


def test_backoff_grows_with_jitter_and_honours_retry_after() -> None:
    rng = random.Random(1)
    for attempt, ceiling in ((1, 1.0), (2, 2.0), (3, 4.0), (9, 60.0)):
        for _ in range(50):
            d = retry_delay_s(attempt, base_s=1.0, max_s=60.0, rng=rng)
            assert ceiling / 2 <= d <= ceiling
    assert retry_delay_s(1, base_s=1.0, max_s=60.0, rng=rng, retry_after_s=30) == 30
    assert retry_delay_s(1, base_s=1.0, max_s=60.0, rng=rng, retry_after_s=999) == 60


def test_secret_box_round_trip_and_wrong_key() -> None:
    box = SecretBox("a-long-enough-key-123")
    token = box.encrypt("whsec_x")
    assert "whsec_x" not in token and box.decrypt(token) == "whsec_x"
    with pytest.raises(SecretKeyError, match="not the key"):
        SecretBox("another-long-key-456").decrypt(token)
    with pytest.raises(SecretKeyError, match="at least 16"):
        SecretBox("short")


def test_body_schema_and_slack_form() -> None:
    t = datetime(2026, 11, 1, tzinfo=UTC)
    inc = IncidentFacts(id="i1", job_id="j", kind="compute_slow", status="validated",
                        severity=1.4, summary="job j compute straggler (1.40x)",
                        culprit=Culprit(gpus=[Gpu(rank=3, node=0, host="h1", device=3)]),
                        opened_at=t,
                        resolved_at=None, gpu_hours_lost=12.5)
    key = delivery_key("incident.validated", "i1", "bus-event-7")
    body = incident_payload("incident.validated", key, inc, occurred_at=t, dashboard="http://d/")
    assert key == "bus-event-7" and delivery_key("incident.opened", "i1", "x") == "i1.opened"
    assert body["schema"] == SCHEMA and body["occurred_at"] == "2026-11-01T00:00:00Z"
    assert body["incident"]["url"] == "http://d/#/incidents/i1"
    fields = body["blocks"][1]["fields"]
    assert {"type": "mrkdwn", "text": "*Culprit*\nGPU h1:3 (rank 3)"} in fields
    assert {"type": "mrkdwn", "text": "*Cost so far*\n12.5 GPU-hours"} in fields
    assert for_format(body, "slack") == {"text": body["text"], "blocks": body["blocks"]}
    assert wants([], "incident.opened") and not wants([], "webhook.test")
    assert not wants(["incident.resolved"], "incident.opened")
