"""Where a webhook may post, and what one attempt may cost: every address a host resolves to is
checked before anything connects (a socket audit hook sees every connect this process makes),
loopback, link-local, private and the rest refused unless GREYHOUND_WEBHOOK_ALLOW_HOSTS allows
them; the attempt connects to the checked address; the receiver's reply text is never kept; and
a receiver that answers a byte at a time cannot hold a sender past its timeout."""

from __future__ import annotations

import asyncio
import ipaddress
import sys
import time
from collections.abc import Iterator

import pytest

from services.common.webhooks.destination import (
    AllowList,
    DestinationRefused,
    check_literal,
    origin,
    resolve,
)
from services.common.webhooks.sender import attempt
from tests.services.notifier.receiver import Receiver, free_port

SECRET = "whsec_destination-test"
NONE = AllowList()
LOOPBACK = AllowList.parse("127.0.0.1")
_connects: list[tuple[str, object]] | None = None


def _audit(event: str, args: tuple[object, ...]) -> None:
    if event == "socket.connect" and _connects is not None:
        _connects.append((event, args[1]))


sys.addaudithook(_audit)


@pytest.fixture()
def connects() -> Iterator[list[tuple[str, object]]]:
    """Every socket connect this process makes while the test runs (an audit hook cannot be
    removed: it records only while a test holds this)."""
    global _connects
    _connects = []
    try:
        yield _connects
    finally:
        _connects = None


REFUSED = ["http://127.0.0.1:8222/varz", "http://169.254.169.254/latest/meta-data/",
           "http://[::1]/", "http://[::ffff:127.0.0.1]/", "http://10.1.2.3/", "http://192.168.0.1/",
           "http://172.16.5.4/", "http://100.64.0.1/", "http://0.0.0.0/", "http://[fe80::1]/",
           "http://[fd00::1]/", "http://224.0.0.1/", "https://localhost:8443/"]


@pytest.mark.parametrize("url", REFUSED)
def test_addresses_that_are_not_public_are_refused_as_written(url: str) -> None:
    with pytest.raises(DestinationRefused, match="GREYHOUND_WEBHOOK_ALLOW_HOSTS"):
        check_literal(url, NONE)


def test_the_allow_list_takes_hosts_addresses_and_networks() -> None:
    allow = AllowList.parse(" 127.0.0.1, 10.0.0.0/8,alerts.internal ,fd00::/8")
    for url in ("http://127.0.0.1:9/x", "http://10.9.8.7/", "http://[fd00::5]/"):
        check_literal(url, allow)
    with pytest.raises(DestinationRefused):
        check_literal("http://169.254.169.254/", allow)
    assert allow.allows("ALERTS.internal", ipaddress.ip_address("10.0.0.1"))
    check_literal("https://hooks.slack.com/services/T/B/X", NONE)  # a name: checked when sent
    for bad in ("http://x", "not a host!", "a..b"):
        with pytest.raises(ValueError, match="neither a host name"):
            AllowList.parse(bad)
    assert origin("https://u:p@hooks.slack.com:443/services/T/B/SECRET") == \
        "https://hooks.slack.com:443"


async def test_a_name_is_resolved_and_every_address_checked(connects: list[object]) -> None:
    with pytest.raises(DestinationRefused, match=r"resolves to 127\.0\.0\.1, loopback"):
        await resolve("http://localhost:9/x", NONE)
    dest = await resolve("http://localhost:9/x", AllowList.parse("localhost"))
    assert dest.address.is_loopback and dest.pinned_url().startswith("http://")
    assert "localhost" not in dest.pinned_url() and dest.pinned_url().endswith(":9/x")
    assert connects == []  # resolving is no connection


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest/meta-data/",
                                 "http://127.0.0.1:{port}/hook", "http://localhost:{port}/hook"])
async def test_a_refused_destination_is_never_connected_to(url: str,
                                                           connects: list[object]) -> None:
    rx = Receiver(SECRET)
    await rx.start()
    try:
        got = await attempt(url.format(port=rx.port), SECRET, b"{}", key="k", event="e",
                            number=1, timeout_s=2.0, allow=NONE)
    finally:
        await rx.stop()
    assert got.outcome == "rejected" and not got.retryable
    assert got.error is not None and got.error.startswith("destination refused")
    assert rx.requests == 0
    assert not [c for c in connects if "169.254" in str(c) or str(rx.port) in str(c)], connects


async def test_the_reply_text_is_never_kept(connects: list[object]) -> None:
    rx = Receiver(SECRET)
    rx.fail_next = 1  # answers 500 with a body of its own
    await rx.start()
    try:
        got = await attempt(rx.url, SECRET, b"{}", key="k", event="e", number=1, timeout_s=2.0,
                            allow=LOOPBACK)
    finally:
        await rx.stop()
    assert (got.outcome, got.status_code, got.error) == ("http_error", 500, "HTTP 500")
    assert rx.requests == 1 and any(str(rx.port) in str(c) for c in connects)


async def test_one_attempt_ends_at_its_timeout_whatever_the_receiver_does() -> None:
    """A receiver that sends its status line and then a header byte every 0.2 s: each read
    succeeds in time, so only a deadline on the whole attempt ends it."""
    port = free_port()

    async def drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1024)
        writer.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
        try:
            while True:
                await asyncio.sleep(0.2)
                writer.write(b"a")
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            writer.close()

    server = await asyncio.start_server(drip, "127.0.0.1", port)
    try:
        t0 = time.monotonic()
        got = await asyncio.wait_for(attempt(
            f"http://127.0.0.1:{port}/hook", SECRET, b"{}", key="k", event="e", number=1,
            timeout_s=1.0, allow=LOOPBACK), 20)
        took = time.monotonic() - t0
    finally:
        server.close()
    assert got.outcome == "timeout" and got.retryable
    assert took < 5.0, f"the attempt took {took:.1f}s against its 1 s timeout"


async def test_a_reply_of_endless_headers_is_cut_off_not_read() -> None:
    """The reply is capped: its body is never read, and a status line followed by megabytes of
    header (sent as fast as the socket takes them) ends the attempt after the first 100 KiB
    (httpcore's limit), well before its deadline, as a failure to retry."""
    port = free_port()
    sent = 0

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        await reader.read(1024)
        writer.write(b"HTTP/1.1 200 OK\r\nX-Big: ")
        try:
            while sent < 64 * 1024**2:
                writer.write(b"a" * 65536)
                await writer.drain()
                sent += 65536
        except (ConnectionError, asyncio.CancelledError):
            pass
        writer.close()

    server = await asyncio.start_server(flood, "127.0.0.1", port)
    try:
        got = await asyncio.wait_for(attempt(
            f"http://127.0.0.1:{port}/hook", SECRET, b"{}", key="k", event="e", number=1,
            timeout_s=10.0, allow=LOOPBACK), 30)
    finally:
        server.close()
    assert got.outcome == "connection_error" and got.retryable and got.status_code is None
    assert got.duration_ms < 10_000 and sent < 64 * 1024**2
