"""Signing a webhook delivery, and the check a receiver runs (documented in docs/webhooks.md).

The signature is HMAC-SHA256 over ``"<unix seconds>." + body`` with the webhook's secret, sent as
``Greyhound-Signature: t=<unix seconds>,v1=<hex>``. Binding the timestamp into the MAC lets a
receiver refuse old requests (a replay outside the tolerance); the idempotency key
(``Greyhound-Delivery``, the same on every retry of one event) lets it refuse a replay inside the
tolerance and ignore our own retries of what it already processed.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict

SIGNATURE_HEADER = "Greyhound-Signature"
DELIVERY_HEADER = "Greyhound-Delivery"
EVENT_HEADER = "Greyhound-Event"
ATTEMPT_HEADER = "Greyhound-Attempt"
TOLERANCE_S = 300


class SignatureError(ValueError):
    """The request is not signed by the shared secret, or is too old, or was seen before."""


def new_secret() -> str:
    return "whsec_" + secrets.token_urlsafe(32)


def sign(secret: str, timestamp: int, body: bytes) -> str:
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def verify(secret: str, header: str, body: bytes, *, now: float | None = None,
           tolerance_s: float = TOLERANCE_S) -> int:
    """The signed timestamp when ``header`` signs ``body`` and is recent; SignatureError if not."""
    fields = dict(part.split("=", 1) for part in header.split(",") if "=" in part)
    try:
        timestamp = int(fields["t"])
        given = fields["v1"]
    except (KeyError, ValueError) as exc:
        raise SignatureError("malformed signature header") from exc
    expected = sign(secret, timestamp, body).split("v1=", 1)[1]
    if not hmac.compare_digest(expected, given):
        raise SignatureError("signature does not match")
    if abs((time.time() if now is None else now) - timestamp) > tolerance_s:
        raise SignatureError("timestamp outside the tolerance (a replay, or a skewed clock)")
    return timestamp


class ReplayGuard:
    """A receiver's memory of the idempotency keys it processed within the tolerance window.

    A key seen again is a replay or our own retry of a delivery whose answer was lost: either
    way the receiver answers 2xx and does nothing. Anything older than the window is refused by
    ``verify``, so keys are kept only that long (and at most ``max_keys`` of them)."""

    def __init__(self, tolerance_s: float = TOLERANCE_S, max_keys: int = 100_000) -> None:
        self.tolerance_s = tolerance_s
        self.max_keys = max_keys
        self._seen: OrderedDict[str, float] = OrderedDict()

    def first_time(self, key: str, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        while self._seen and (next(iter(self._seen.values())) < now - 2 * self.tolerance_s
                              or len(self._seen) > self.max_keys):
            self._seen.popitem(last=False)
        if key in self._seen:
            return False
        self._seen[key] = now
        return True
