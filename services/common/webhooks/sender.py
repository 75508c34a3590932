"""One HTTP attempt of one delivery, and what it means for the next one.

Redirects are not followed (a webhook URL is where the body goes, nothing else); a 2xx answer
delivers; a timeout, a connection failure, 408, 425, 429 or a 5xx is retried with back-off; any
other answer is the receiver refusing the request (bad signature, unknown endpoint), which no
retry fixes, so the delivery fails at once and the attempt log says why.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Literal

import httpx

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


async def attempt(client: httpx.AsyncClient, url: str, secret: str, body: bytes, *, key: str,
                  event: str, number: int, timeout_s: float) -> Attempt:
    timestamp = int(time.time())
    headers = {"Content-Type": "application/json", "User-Agent": USER_AGENT,
               SIGNATURE_HEADER: sign(secret, timestamp, body), DELIVERY_HEADER: key,
               "Idempotency-Key": key, EVENT_HEADER: event, ATTEMPT_HEADER: str(number)}
    t0 = time.perf_counter()
    try:
        resp = await client.post(url, content=body, headers=headers, timeout=timeout_s,
                                 follow_redirects=False)
    except httpx.TimeoutException as exc:
        return Attempt("timeout", None, f"no answer within {timeout_s:g}s ({type(exc).__name__})",
                       (time.perf_counter() - t0) * 1e3)
    except httpx.HTTPError as exc:
        return Attempt("connection_error", None, f"{type(exc).__name__}: {exc}"[:500],
                       (time.perf_counter() - t0) * 1e3)
    ms = (time.perf_counter() - t0) * 1e3
    code = resp.status_code
    if 200 <= code < 300:
        return Attempt("delivered", code, None, ms)
    snippet = resp.text[:300] if resp.content else ""
    error = f"HTTP {code}" + (f": {snippet}" if snippet else "")
    if code in _RETRY_STATUS or code >= 500:
        return Attempt("http_error", code, error, ms, _retry_after(resp))
    return Attempt("rejected", code, error, ms)
