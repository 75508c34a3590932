"""The containers' health checks (deploy/compose.yaml), with the standard library only: a
check runs every few seconds in every container, so it must not load the services' imports.

``connected URL|PORT...``: this container holds an established TCP connection to each port (a
service's link to NATS, ``tls://nats:4222``: down while the service has lost the bus).
``https URL --ca FILE``: the URL answers 200 over TLS with a certificate ``FILE`` vouches for.
Exit 0 when healthy, 1 with the reason otherwise.
"""

from __future__ import annotations

import argparse
import ssl
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

ESTABLISHED = "01"


def remote_ports(tables: Sequence[Path] = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
                 ) -> set[int]:
    """Remote ports of this network namespace's established TCP connections."""
    ports: set[int] = set()
    for table in tables:
        try:
            rows = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 3 and cols[3] == ESTABLISHED:
                ports.add(int(cols[2].rsplit(":", 1)[1], 16))
    return ports


def port_of(target: str) -> int:
    """``4222`` or ``tls://nats:4222``."""
    if target.isdigit():
        return int(target)
    port = urlsplit(target).port
    if port is None:
        raise ValueError(f"{target!r} names no port")
    return port


def check_connected(targets: Sequence[str]) -> str | None:
    missing = sorted({port_of(t) for t in targets} - remote_ports())
    return f"no established connection to port(s) {missing}" if missing else None


def check_https(url: str, ca: Path, timeout_s: float = 4.0) -> str | None:
    context = ssl.create_default_context(cafile=str(ca))
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as r:
            status = int(r.status)
    except OSError as exc:
        return f"{url}: {exc}"
    return None if status == 200 else f"{url}: HTTP {status}"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stack.deploy.health")
    sub = p.add_subparsers(dest="check", required=True)
    c = sub.add_parser("connected")
    c.add_argument("targets", nargs="+")
    h = sub.add_parser("https")
    h.add_argument("url")
    h.add_argument("--ca", type=Path, required=True)
    args = p.parse_args(argv)
    why = (check_connected(args.targets) if args.check == "connected"
           else check_https(args.url, args.ca))
    if why is not None:
        print(why, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
