"""At start, before any work: may this process's bus user do what its code will do?

A grant the server lacks does not fail a call: the server drops the message and the caller's
request times out (services.common.bus.refusals). Met at run time, deep in a handler, that looks
like a slow bus and wedges the service (a tracker that cannot read its saved state back did so
on every restart). So each service asks first, for everything its grants say it does
(services.common.bus.grants): it checks the streams (for real, as it would anyway: creating a
missing one, refusing a different one, services.common.bus.client.check_stream) and sends
one harmless request or publish per other JetStream API subject and contract subject its code
uses, exactly as nats-py sends them, and refuses to start with a message naming every refused
grant and what it is for.

Harmless, each of them, on a server that allows it (tests/services/common/test_preflight.py
checks that a check changes nothing): a JetStream API request with a body the server rejects
before acting (``{probe``: not JSON; MSG.NEXT fetches nothing with it), a read (INFO, NAMES, an
empty LIST), a purge filtered to a subject no object can have, a publish with a
``Nats-Expected-Stream`` header no stream has (a stream refuses to store it; nothing else
listens on the probe job's subjects), an ack to a subject no delivery has, and a subscription
dropped at once. What needs no probe: the reply inbox (every request above uses it), and the
answers to requests a service serves (``allow_responses``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from services.common.bus.auth import BusAuthError, agent_of_user
from services.common.bus.client import BusClient, check_stream
from services.common.bus.contract import Subjects
from services.common.bus.grants import BusAccess, Consume
from services.common.bus.permissions import bind_agent
from services.common.bus.refusals import HOW_TO_GRANT, Action, PermissionDenied
from services.common.bus.streams import STREAMS, partition_durable, stream_configs
from services.common.settings import Settings

log = logging.getLogger(__name__)

API = "$JS.API"
PROBE = "greyhound-grant-probe"  # a job, agent and object token nothing real is named
NOT_JSON = b"{probe"
WRONG_STREAM = {"Nats-Expected-Stream": PROBE}
TIMEOUT_S = 5

How = Literal["request", "publish", "subscribe"]


@dataclass(frozen=True, slots=True)
class Need:
    """One thing the service's code does on the bus, and its harmless stand-in."""

    how: How
    subject: str
    doing: str
    payload: bytes = b""
    headers: dict[str, str] | None = field(default=None, hash=False)

    @property
    def action(self) -> str:
        return "subscribe to" if self.how == "subscribe" else "publish to"


class MissingGrants(BusAuthError):
    """The server refuses this process's bus user something its code needs."""

    def __init__(self, user: str | None, service: str, missing: list[Need]) -> None:
        who = f"bus user {user!r}" if user else "this connection (no bus user)"
        lines = "\n".join(f"  - {n.action} {n.subject}: {n.doing}" for n in missing)
        super().__init__(f"{service} cannot start: the server refuses {who} {len(missing)} "
                         f"thing(s) its code does:\n{lines}\n{HOW_TO_GRANT}")
        self.missing = missing


def _concrete(pattern: str) -> str:
    """A subject a wildcard grant covers, with the probe token for each wildcard."""
    return ".".join(PROBE if t in ("*", ">") else t for t in pattern.split("."))


def _durable(c: Consume, settings: Settings) -> str:
    # partition 0's (or the one configured): every partition's is granted alike
    return partition_durable(c.durable, settings.tracker_partition, settings.tracker_partitions) \
        if c.partitioned else c.durable


def _consumer(stream: str, name: str) -> list[Need]:
    """What services.common.bus.client.Consumer does with its durable: bind it (create or
    update, by name, with several filter subjects), look it up, fetch, ack, nak and term,
    and dead-letter what fails for good."""
    what = f"durable consumer {name!r} on {stream}"
    return [
        Need("request", f"{API}.CONSUMER.CREATE.{stream}.{name}", f"bind {what}", NOT_JSON),
        Need("request", f"{API}.CONSUMER.INFO.{stream}.{name}", f"check that {what} exists"),
        Need("request", f"{API}.CONSUMER.MSG.NEXT.{stream}.{name}", f"fetch from {what}",
             NOT_JSON),
        Need("publish", f"$JS.ACK.{stream}.{name}.{PROBE}", f"acknowledge messages of {what}",
             b"-NAK"),
        Need("request", Subjects.dead_letter(stream), f"dead-letter messages of {what}",
             headers=WRONG_STREAM),
    ]


def _reader(stream: str) -> list[Need]:
    """services.common.bus.reader.TelemetryReader: a consumer of its own (any name but the
    durables'), one filter subject, looked up, fetched from and deleted."""
    name = f"{PROBE}-{uuid.uuid4().hex[:8]}"
    what = f"read {stream} with a short-lived consumer of its own"
    return [
        Need("request", f"{API}.CONSUMER.CREATE.{stream}.{name}.{_concrete(Subjects.ALL_ITERATIONS)}",
             what, NOT_JSON),
        Need("request", f"{API}.CONSUMER.INFO.{stream}.{name}", what),
        Need("request", f"{API}.CONSUMER.MSG.NEXT.{stream}.{name}", what, NOT_JSON),
        # a delete with a body is refused before anything is looked up
        Need("request", f"{API}.CONSUMER.DELETE.{stream}.{name}", what, NOT_JSON),
    ]


def _object_store(bucket: str) -> list[Need]:
    """What services.tracker.state_store does through nats-py's object store: open or create
    the bucket and bring it to its limits, put, get (nats-py finds the bucket's stream by
    subject, then reads the chunks with an ordered consumer of its own, flow-controlled) and
    delete (a filtered purge)."""
    obj = f"OBJ_{bucket}"
    what = f"object store {bucket!r}"
    chunk = f"$O.{bucket}.C.{PROBE}"
    return [
        Need("request", f"{API}.STREAM.INFO.{obj}", f"open {what}"),
        Need("request", f"{API}.STREAM.CREATE.{obj}", f"create {what}", NOT_JSON),
        Need("request", f"{API}.STREAM.UPDATE.{obj}", f"bring {what} to its limits", NOT_JSON),
        Need("request", f"{API}.STREAM.MSG.GET.{obj}", f"look an object up in {what}", NOT_JSON),
        Need("request", chunk, f"write an object to {what}", headers=WRONG_STREAM),
        Need("request", f"$O.{bucket}.M.{PROBE}", f"write an object to {what}",
             headers=WRONG_STREAM),
        Need("request", f"{API}.STREAM.NAMES", f"read an object of {what} back (nats-py finds "
             "the bucket's stream by subject)", json.dumps({"subject": chunk}).encode()),
        Need("request", f"{API}.CONSUMER.CREATE.{obj}", f"read an object of {what} back",
             NOT_JSON),
        Need("publish", f"$JS.FC.{obj}.{PROBE}", f"read a large object of {what} back "
             "(flow control)"),
        Need("request", f"{API}.STREAM.PURGE.{obj}", f"delete or replace an object in {what}",
             json.dumps({"filter": chunk}).encode()),
    ]


def needs(access: BusAccess, settings: Settings, agent_id: str | None = None) -> list[Need]:
    """Everything a service with these grants does on the bus, but checking the
    streams (done for real by ``check``); a per-agent line's subjects end in ``agent_id``."""
    out: list[Need] = []
    publish, serve = access.publish, access.serve
    if access.per_agent and agent_id is not None:
        publish = tuple(bind_agent(p, agent_id) for p in publish)
        serve = tuple(bind_agent(p, agent_id) for p in serve)
    if access.declare_streams:  # the service only checks; ``greyhound streams apply`` updates
        out += [Need("request", f"{API}.STREAM.UPDATE.{s}", f"bring stream {s} to its "
                     "configuration (greyhound streams apply, as this user)", NOT_JSON)
                for s in STREAMS]
    for c in access.consume:
        out += _consumer(c.stream, _durable(c, settings))
    for stream in access.read:
        out += _reader(stream)
    for bucket in access.object_stores:
        out += _object_store(bucket)
    if access.monitor:
        out.append(Need("request", f"{API}.INFO", "report whether JetStream answers"))
        for s in STREAMS:
            out += [Need("request", f"{API}.STREAM.INFO.{s}", f"report on stream {s}"),
                    Need("request", f"{API}.CONSUMER.LIST.{s}", f"report on consumers of {s}"),
                    Need("request", f"{API}.CONSUMER.NAMES.{s}", f"report on consumers of {s}")]
    out += [Need("request", _concrete(p), f"publish {p}", headers=WRONG_STREAM) for p in publish]
    out += [Need("subscribe", _concrete(p), f"answer requests on {p}") for p in serve]
    return out


async def _try(nc: BusClient, need: Need) -> bool | None:
    """True: allowed; False: refused; None: no answer, so the check cannot tell."""
    t = time.monotonic()
    if need.how == "request":
        try:
            await nc.request(need.subject, need.payload, timeout=TIMEOUT_S, headers=need.headers)
        except PermissionDenied:
            return False
        except nats.errors.NoRespondersError:
            return True  # allowed; nobody listens for the probe
        except nats.errors.TimeoutError:
            return None
        return True
    if need.how == "publish":
        await nc.publish(need.subject, need.payload)
    else:
        sub = await nc.subscribe(need.subject)
    try:
        # The server answers in order, so a refusal comes before the PONG of a PING sent after
        # the command; nats-py writes a PING ahead of commands still buffered, so the second
        # round trip is the one that surely follows it.
        for _ in range(2):
            await nc.flush(timeout=TIMEOUT_S)
    except nats.errors.TimeoutError:
        return None
    finally:
        if need.how == "subscribe":
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
    action: Action = "subscribe" if need.how == "subscribe" else "publish"
    return nc.refusals.since(t, need.subject, action) is None


async def _declare(js: JetStreamContext, cfg: StreamConfig) -> Need | None:
    """Check one stream for real (the service would anyway); what was refused, if it was.
    A stream configured otherwise raises StreamMismatch."""
    try:
        await check_stream(js, cfg)
    except PermissionDenied as exc:
        subject = next((x for x in (f"{API}.STREAM.{op}.{cfg.name}" for op in ("INFO", "CREATE"))
                        if exc.refusal.covers(x)), exc.refusal.subject)
        return Need("request", subject, f"declare stream {cfg.name}")
    return None


async def check(nc: BusClient, js: JetStreamContext, service: str, access: BusAccess,
                settings: Settings) -> None:
    """Check the streams (if the line does; StreamMismatch where one differs) and try
    everything else the line's code does; raise MissingGrants naming each refusal. An
    unanswered probe is logged, not held against the service (the bus may be slow); the code
    meets it again, as a PermissionDenied if it was a refusal after all."""
    missing: list[Need] = []
    if access.declare_streams:
        missing += [n for n in await asyncio.gather(*(_declare(js, c)
                                                      for c in stream_configs(settings))) if n]
    agent = agent_of_user(nc.bus_user) if nc.bus_user is not None else None
    todo = needs(access, settings, agent)
    results = await asyncio.gather(*(_try(nc, n) for n in todo))
    missing += [n for n, ok in zip(todo, results, strict=True) if ok is False]
    unanswered = [n for n, ok in zip(todo, results, strict=True) if ok is None]
    if unanswered:
        log.warning("%s: %d bus check(s) got no answer within %ds (e.g. %s); starting anyway",
                    service, len(unanswered), TIMEOUT_S, unanswered[0].subject)
    if missing:
        raise MissingGrants(nc.bus_user, service, _unique(missing))
    log.debug("%s: bus user %r holds all %d grant(s) its code uses", service, nc.bus_user,
              len(todo))


def _unique(items: Iterable[Need]) -> list[Need]:
    return list({(n.how, n.subject): n for n in items}.values())
