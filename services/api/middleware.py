"""What every request passes through before a route: its size, its pace, the headers every
answer carries, and the request metrics.

Plain ASGI, not Starlette's BaseHTTPMiddleware: that one runs the route in a task of its own
and cancels it when the client goes away, mid-query included, leaving the request's database
session to a cleanup that is itself cancelled.

* A body over ``api_max_body_bytes`` is a 413, refused on its Content-Length before anything
  is read, or as soon as a body sent without one (chunked) grows past the limit. The largest
  body any route takes (a layout, a webhook) is a few kilobytes.
* Requests are metered per client address (a token bucket: ``api_rate_per_s`` sustained,
  ``api_rate_burst`` at once), 429 with Retry-After past it; so are failed authentications
  (``api_auth_failures_per_min``): a client that keeps sending unknown tokens is answered 429
  before its tokens are looked up. Each failed authentication is logged with the client's
  address and the route (services.api.auth).
* Every answer says ``nosniff``, no framing and no referrer; the dashboard's pages get a
  Content-Security-Policy that allows only this origin's own scripts, styles and API (the
  page's inline handlers and any injected markup do not run).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass

from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.api.metrics import REQUEST_SECONDS, REQUESTS

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
       "frame-ancestors 'none'")
HEADERS = [(b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY"),
           (b"referrer-policy", b"no-referrer")]
MAX_CLIENTS = 10_000  # buckets kept; the least recently seen go first


@dataclass
class Bucket:
    tokens: float
    at: float


class Buckets:
    """One token bucket per client address, for a bounded number of clients."""

    def __init__(self, rate_per_s: float, burst: float) -> None:
        self.rate, self.burst = rate_per_s, burst
        self._by: OrderedDict[str, Bucket] = OrderedDict()

    def _bucket(self, client: str, now: float) -> Bucket:
        b = self._by.pop(client, None) or Bucket(self.burst, now)
        b.tokens = min(self.burst, b.tokens + (now - b.at) * self.rate)
        b.at = now
        self._by[client] = b
        while len(self._by) > MAX_CLIENTS:
            self._by.popitem(last=False)
        return b

    def wait_s(self, client: str, now: float | None = None) -> float:
        """0 when ``client`` may go on now, else how long until it may."""
        b = self._bucket(client, time.monotonic() if now is None else now)
        return 0.0 if b.tokens >= 1 else (1 - b.tokens) / self.rate

    def take(self, client: str, now: float | None = None) -> float:
        """Spend one token if there is one; 0 when it was there, else the wait."""
        b = self._bucket(client, time.monotonic() if now is None else now)
        if b.tokens >= 1:
            b.tokens -= 1
            return 0.0
        return (1 - b.tokens) / self.rate


def client_of(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


async def _problem(send: Send, status: int, title: str, detail: str,
                   retry_after_s: float | None = None) -> None:
    body = (f'{{"type":"about:blank","title":"{title}","status":{status},'
            f'"detail":"{detail}"}}').encode()
    headers = [(b"content-type", b"application/problem+json"),
               (b"content-length", str(len(body)).encode()), *HEADERS]
    if retry_after_s is not None:
        headers.append((b"retry-after", str(max(1, math.ceil(retry_after_s))).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """The size limit, the rate limits, the headers and the request metrics, around the app
    (see the module docstring)."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, requests: Buckets,
                 auth_failures: Buckets) -> None:
        self.app = app
        self.max_body = max_body_bytes
        self.requests = requests
        self.auth_failures = auth_failures

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0, client, status = time.perf_counter(), client_of(scope), 500
        scope.setdefault("state", {})["auth_failures"] = self.auth_failures

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                headers += HEADERS
                if scope["path"].startswith("/dashboard"):
                    headers.append((b"content-security-policy", CSP.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self._guarded(scope, receive, sending, client)
        finally:
            route = scope.get("route")
            name = route.path_format if isinstance(route, APIRoute) else "other"
            REQUESTS.labels(scope["method"], name, str(status)).inc()
            REQUEST_SECONDS.labels(name).observe(time.perf_counter() - t0)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send, client: str) -> None:
        wait = self.requests.take(client)
        if not wait and _has_bearer(scope):
            wait = self.auth_failures.wait_s(client)
        if wait:
            await _problem(send, 429, "Too Many Requests",
                           "too many requests (or failed logins) from this address", wait)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_body:
            await _problem(send, 413, "Content Too Large",
                           f"the body is over {self.max_body} bytes")
            return
        seen, over = 0, False

        async def counted() -> Message:
            """The body as it comes, cut off once past the limit (the route then answers
            whatever it answers to half a body, and that answer is replaced below)."""
            nonlocal seen, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    over = True
                    return {"type": "http.request", "body": b"", "more_body": False}
            return message

        async def answering(message: Message) -> None:
            if not over:
                await send(message)
            elif message["type"] == "http.response.start":
                await _problem(send, 413, "Content Too Large",
                               f"the body is over {self.max_body} bytes")

        await self.app(scope, counted, answering)


def _headers(scope: Scope) -> dict[bytes, bytes]:
    return {k.lower(): v for k, v in scope.get("headers", [])}


def _has_bearer(scope: Scope) -> bool:
    return _headers(scope).get(b"authorization", b"").lower().startswith(b"bearer ")


def _content_length(scope: Scope) -> int | None:
    raw = _headers(scope).get(b"content-length")
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None
