"""One HTTP attempt of one delivery, and what it means for the next one.

Redirects are not followed (a webhook URL is where the body goes, nothing else); a 2xx answer
delivers; a timeout, a connection failure, 408, 425, 429 or a 5xx is retried with back-off; any
other answer is the receiver refusing the request (bad signature, unknown endpoint), which no
retry fixes, so the delivery fails at once and the attempt log says why; so does a destination
webhooks may not reach (services.common.webhooks.destination).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

import httpx

from services.common.webhooks.destination import AllowList, DestinationRefused, resolve
from services.common.webhooks.signing import (
    ATTEMPT_HEADER,
    DELIVERY_HEADER,
    EVENT_HEADER,
    SIGNATURE_HEADER,
    sign,
)

Outcome = Literal["delivered", "http_error", "rejected", "timeout", "connection_error"]
_RETRY_STATUS = {408, 425, 429}
USER_AGENT = "greyhound-notifier/1"


@dataclass(frozen=True)
class Attempt:
    outcome: Outcome
    status_code: int | None
    error: str | None
    duration_ms: float
    retry_after_s: float | None = None

    @property
    def retryable(self) -> bool:
        return self.outcome in ("http_error", "timeout", "connection_error")


def retry_delay_s(attempt: int, *, base_s: float, max_s: float, rng: random.Random,
                  retry_after_s: float | None = None) -> float:
    """Exponential back-off with jitter after the ``attempt``-th failure (1-based).

    The ceiling doubles per attempt up to ``max_s``; the delay is drawn between half the ceiling
    and the ceiling, so receivers recovering from an outage are not hit by every sender at once,
    and a retry never comes much sooner than the schedule. A receiver's Retry-After (429/503)
    is honoured up to ``max_s``."""
    ceiling = min(max_s, base_s * 2.0 ** max(attempt - 1, 0))
    delay = ceiling * (0.5 + 0.5 * rng.random())
    if retry_after_s is not None:
        delay = max(delay, min(retry_after_s, max_s))
    return delay


def _retry_after(resp: httpx.Response) -> float | None:
    value = resp.headers.get("retry-after")
    try:
        return max(float(value), 0.0) if value is not None else None
    except ValueError:
        return None


async def attempt(url: str, secret: str, body: bytes, *, key: str, event: str, number: int,
                  timeout_s: float, allow: AllowList) -> Attempt:
    """One signed POST, within ``timeout_s`` all told (resolving, connecting, sending and the
    receiver's status line: httpx's own timeouts are per step, so a receiver that answers a
    byte at a time could hold a sender for ever). The destination is checked and pinned first
    (services.common.webhooks.destination). The reply's body is never read: nothing a receiver
    says is kept or shown, only its status and Retry-After."""
    timestamp = int(time.time())
    headers = {"Content-Type": "application/json", "User-Agent": USER_AGENT,
               SIGNATURE_HEADER: sign(secret, timestamp, body, key), DELIVERY_HEADER: key,
               "Idempotency-Key": key, EVENT_HEADER: event, ATTEMPT_HEADER: str(number)}
    t0 = time.perf_counter()

    def ms() -> float:
        return (time.perf_counter() - t0) * 1e3

    try:
        async with asyncio.timeout(timeout_s):
            dest = await resolve(url, allow)
            headers["Host"] = urlsplit(url).netloc.rpartition("@")[2]
            # A client per attempt: a pooled connection to the same address opened for another
            # host name would carry that name's TLS session.
            async with httpx.AsyncClient(follow_redirects=False, timeout=timeout_s) as client, \
                    client.stream("POST", dest.pinned_url(), content=body, headers=headers,
                                  extensions={"sni_hostname": dest.host}) as resp:
                code, retry_after = resp.status_code, _retry_after(resp)
    except DestinationRefused as exc:
        return Attempt("rejected", None, f"destination refused: {exc}", ms())
    except (TimeoutError, httpx.TimeoutException):
        return Attempt("timeout", None, f"no answer within {timeout_s:g}s", ms())
    except (httpx.HTTPError, OSError) as exc:
        return Attempt("connection_error", None, f"{type(exc).__name__}: {exc}"[:300], ms())
    if 200 <= code < 300:
        return Attempt("delivered", code, None, ms())
    if code in _RETRY_STATUS or code >= 500:
        return Attempt("http_error", code, f"HTTP {code}", ms(), retry_after)
    return Attempt("rejected", code, f"HTTP {code}", ms())
