"""Signing a webhook delivery, and the check a receiver runs (documented in docs/webhooks.md).

The signature is HMAC-SHA256 with the webhook's secret over ``"<unix seconds>.<delivery>." +
body``, sent as ``Greyhound-Signature: t=<unix seconds>,v1=<hex>,v2=<hex>`` (``v2``; ``v1``
is the MAC over ``"<unix seconds>." + body`` alone, for receivers written before ``v2``).
Binding the timestamp into the MAC lets a receiver refuse old requests (a replay outside the
tolerance); the idempotency key (``Greyhound-Delivery``, the same on every retry of one event)
lets it refuse a replay inside the tolerance and ignore our own retries of what it already
processed, which it can trust only because ``v2`` signs it: with ``v1`` alone, a captured
request replayed with a new key would pass as a new event.
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


def _mac(secret: str, signed: bytes) -> str:
    return hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()


def sign(secret: str, timestamp: int, body: bytes, delivery: str) -> str:
    v1 = _mac(secret, f"{timestamp}.".encode() + body)
    v2 = _mac(secret, f"{timestamp}.{delivery}.".encode() + body)
    return f"t={timestamp},v1={v1},v2={v2}"


def verify(secret: str, header: str, body: bytes, *, delivery: str | None = None,
           now: float | None = None, tolerance_s: float = TOLERANCE_S) -> int:
    """The signed timestamp when ``header`` signs ``body`` (and ``delivery``, the
    Greyhound-Delivery header, when given: ``v2``, which a receiver that de-duplicates on it
    must check) and is recent; SignatureError if not."""
    fields = dict(part.split("=", 1) for part in header.split(",") if "=" in part)
    version = "v1" if delivery is None else "v2"
    try:
        timestamp = int(fields["t"])
        given = fields[version]
    except (KeyError, ValueError) as exc:
        raise SignatureError(f"malformed signature header (no t or {version})") from exc
    signed = f"{timestamp}.".encode() if delivery is None else f"{timestamp}.{delivery}.".encode()
    expected = _mac(secret, signed + body)
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
