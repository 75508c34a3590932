"""``greyhound dlq list|replay``: the dead letters, and sending them back once what failed them
is fixed (services.common.bus.dlq).

It needs NATS only, as a bus user that may read the dead-letter stream and publish on the
subjects it replays: the data directory's ``operator`` on the embedded NATS (docs/security.md),
else the user of ``GREYHOUND_NATS_USER`` / ``_PASSWORD``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import UTC, datetime
from typing import TextIO

from services.common.bus.auth import tls_context
from services.common.bus.client import connect
from services.common.bus.dlq import Letter, Selection, letters, replay
from services.common.embedded import OPERATOR
from services.common.runtime import resolve_backends
from services.common.settings import Settings

HELP = "dead letters: list them, replay them once what failed them is fixed"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("dlq", help=HELP)
    dsub = p.add_subparsers(dest="dlq_command", required=True)
    for name, text in (("list", "the dead letters (newest last)"),
                       ("replay", "publish the chosen letters again where they were published, "
                                  "and drop them")):
        c = dsub.add_parser(name, help=text)
        c.add_argument("--stream", default=None, help="letters of this stream (GH_EVENTS, ...)")
        c.add_argument("--consumer", default=None, help="letters of this durable consumer")
        c.add_argument("--reason", default=None,
                       help="letters whose reason starts with this (retries_exhausted, ...)")
        c.add_argument("--seq", type=int, action="append", default=[],
                       help="this letter (its number in the list; repeatable)")
    p.set_defaults(func=None)


def _line(item: Letter) -> str:
    x = item.letter
    at = datetime.fromtimestamp(x.ts, UTC).isoformat(timespec="seconds")
    cut = "" if item.replayable else " (payload cut: not replayable)"
    return f"{item.seq:>8}  {at}  {x.consumer:<20} {x.subject}  {x.reason[:160]}{cut}"


async def _run(settings: Settings, args: argparse.Namespace, out: TextIO) -> int:
    backends = resolve_backends(settings, need_db=False, bus_user=OPERATOR)
    try:
        nc = await connect(backends.nats_url, name="greyhound-dlq",
                           credentials=backends.nats_credentials,
                           tls=tls_context(settings.nats_tls_ca, settings.nats_tls_cert,
                                           settings.nats_tls_key))
        try:
            js = nc.jetstream()
            chosen = Selection(stream=args.stream, consumer=args.consumer, reason=args.reason,
                               seqs=frozenset(args.seq))
            found = [item async for item in letters(js, chosen)]
            if args.dlq_command == "list":
                for item in found:
                    print(_line(item), file=out)
                print(f"{len(found)} dead letter(s)", file=sys.stderr)
                return 0
            failed = 0
            for item in found:
                try:
                    await replay(js, item)
                except Exception as exc:  # this letter stays; the others are still tried
                    failed += 1
                    print(f"letter {item.seq} not replayed: {exc}", file=sys.stderr)
                else:
                    print(f"replayed {item.seq} to {item.letter.subject}", file=out)
            print(f"{len(found) - failed} replayed, {failed} kept", file=sys.stderr)
            return 1 if failed else 0
        finally:
            await nc.drain()
    finally:
        backends.stop()


def run(settings: Settings, args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    return asyncio.run(_run(settings, args, out))
