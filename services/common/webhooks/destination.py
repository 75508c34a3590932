"""Where a webhook may post: public addresses only, unless the operator allows more.

A webhook URL is an admin's input, and the API and the notifier send to it from inside the
deployment: to ``http://nats:8222`` (the NATS monitor), ``http://127.0.0.1:...``, a cloud's
metadata address (169.254.169.254) or anything on the private network, a webhook is a way to
reach what only the deployment can reach. So the host is resolved before every attempt and
each address it resolves to must be global (not loopback, link-local, private, shared, reserved,
multicast or unspecified, nor an IPv4 address of those inside IPv6), or allowed by
``GREYHOUND_WEBHOOK_ALLOW_HOSTS`` (comma-separated host names and addresses or CIDR blocks: an
on-call receiver inside the network). The attempt then connects to the address that was
checked, not to a second resolution of the name (which a hostile DNS server could answer
differently), with the name kept for the Host header, TLS's SNI and the certificate check.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

_LABEL = re.compile(r"[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?")
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class DestinationRefused(ValueError):
    """The URL's host is, or resolves to, an address webhooks may not reach."""


@dataclass(frozen=True, slots=True)
class AllowList:
    """``GREYHOUND_WEBHOOK_ALLOW_HOSTS``: host names (matched as written in the URL, without
    case) and networks (an address is a /32 or /128) webhooks may reach though not global."""

    hosts: frozenset[str] = frozenset()
    networks: tuple[Network, ...] = ()

    @staticmethod
    def parse(text: str) -> AllowList:
        """ValueError names an entry that is neither a host name nor an address or CIDR."""
        hosts: set[str] = set()
        networks: list[Network] = []
        for raw in text.split(","):
            entry = raw.strip().lower()
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            if not all(_LABEL.fullmatch(label) for label in entry.split(".")):
                raise ValueError(f"GREYHOUND_WEBHOOK_ALLOW_HOSTS: {raw.strip()!r} is neither a "
                                 "host name nor an address or CIDR block")
            hosts.add(entry)
        return AllowList(frozenset(hosts), tuple(networks))

    def allows(self, host: str, address: Address) -> bool:
        return host.lower() in self.hosts or any(address in n for n in self.networks)


@dataclass(frozen=True, slots=True)
class Destination:
    """A checked URL: its host as written and the address the attempt connects to."""

    url: str
    host: str
    address: Address

    def pinned_url(self) -> str:
        """The URL with the checked address in place of the host name."""
        parts = urlsplit(self.url)
        userinfo, at, _ = parts.netloc.rpartition("@")
        literal = f"[{self.address}]" if self.address.version == 6 else str(self.address)
        port = "" if parts.port is None else f":{parts.port}"
        return parts._replace(netloc=f"{userinfo}{at}{literal}{port}").geturl()


def _why_not(address: Address) -> str | None:
    """Why webhooks may not reach ``address`` unless allowed; None for a global one."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return _why_not(address.ipv4_mapped)
    for what, bad in (("loopback", address.is_loopback), ("link-local", address.is_link_local),
                      ("unspecified", address.is_unspecified),
                      ("multicast", address.is_multicast), ("private", address.is_private),
                      ("reserved", address.is_reserved)):
        if bad:
            return what
    return None if address.is_global else "not global"


def origin(url: str) -> str:
    """``scheme://host[:port]`` of a URL: what may be logged (a Slack webhook's path is its
    secret)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"


def _host(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise DestinationRefused(f"{parts.scheme or 'no'} scheme or no host: webhooks post to "
                                 "http(s) URLs")
    return parts.hostname


def check_literal(url: str, allow: AllowList) -> None:
    """Refuse at once a URL whose host is an address webhooks may not reach (or ``localhost``);
    a host name is resolved, and checked, at every attempt (DNS answers change)."""
    host = _host(url)
    try:
        address: Address = ipaddress.ip_address(host)
    except ValueError:
        if host.lower().rstrip(".") in ("localhost", "localhost.localdomain") \
                and host.lower() not in allow.hosts:
            raise DestinationRefused(f"{host} is this machine (set GREYHOUND_WEBHOOK_ALLOW_HOSTS "
                                     "to allow it)") from None
        return
    why = _why_not(address)
    if why is not None and not allow.allows(host, address):
        raise DestinationRefused(f"{address} is {why}: webhooks post to public addresses "
                                 "unless GREYHOUND_WEBHOOK_ALLOW_HOSTS allows it")


async def resolve(url: str, allow: AllowList) -> Destination:
    """The address the attempt connects to: every address the host resolves to must be global
    or allowed (a name that resolves to a public and a private address is refused: which one
    a client picks is not ours to guess). Raises DestinationRefused, or OSError when the name
    does not resolve (worth a retry)."""
    host = _host(url)
    try:
        literal: Address | None = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:
        addresses = [literal]
    else:
        infos = await asyncio.get_running_loop().getaddrinfo(
            host, None, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        addresses = list(dict.fromkeys(ipaddress.ip_address(str(i[4][0]).split("%", 1)[0])
                                       for i in infos))
    if not addresses:
        raise OSError(f"{host} resolves to no address")
    for address in addresses:
        why = _why_not(address)
        if why is not None and not allow.allows(host, address):
            raise DestinationRefused(
                f"{host} resolves to {address}, {why}: webhooks post to public addresses "
                "unless GREYHOUND_WEBHOOK_ALLOW_HOSTS allows it")
    return Destination(url, host, addresses[0])
