"""The NATS server's users and permissions, generated from the services' grants.

Each service's entry in services.common.bus.grants becomes one user with exactly what the
entry grants; the agent's becomes one user per agent id whose subjects end in that id. What
a grant means on the wire:

* publish ``S``: publish (or send requests) on S; JetStream stores it if a stream listens.
* consume ``(stream, durable)``: create/update and look up that durable, fetch from it, ack
  its messages (``$JS.ACK.<stream>.<durable>.>``), and dead-letter on the stream's DLQ subject.
* read ``stream``: short-lived consumers of its own on the stream (the API's telemetry window);
  every durable some service consumes is denied to it, so it can neither steal nor delete them.
* serve ``S``: subscribe to S and answer (``allow_responses``: only to the reply subject of a
  request it got).
* object store ``B``: the bucket's stream ``OBJ_B`` and its ``$O.B.>`` subjects, and the list
  of stream names (nats-py finds the bucket's stream by subject to read an object back).
* monitor: stream and consumer state (metrics, readiness).

Every user subscribes only under its own reply inbox (services.common.bus.auth.inbox_prefix)
and may not create, delete or purge anything it was not granted. No anonymous user exists: a
connection without credentials is refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from services.common.bus.auth import agent_user, inbox_prefix
from services.common.bus.contract import Subjects
from services.common.bus.grants import GRANTS, BusAccess, Consume
from services.common.bus.streams import STREAMS, partition_durable

API = "$JS.API"


@dataclass(frozen=True, slots=True)
class EnvRef:
    """A password the server reads from its environment (``$NAME`` in the config)."""

    name: str


Password = str | EnvRef


def _durables(c: Consume, tracker_partitions: int) -> list[str]:
    if not c.partitioned or tracker_partitions <= 1:
        return [c.durable]
    return [partition_durable(c.durable, i, tracker_partitions)
            for i in range(tracker_partitions)]


def _consumer_subjects(stream: str, name: str) -> list[str]:
    """Everything binding, fetching from and acking one consumer publishes (no delete: its
    owner never deletes it, and nobody else may)."""
    return [f"{API}.CONSUMER.CREATE.{stream}.{name}", f"{API}.CONSUMER.CREATE.{stream}.{name}.>",
            f"{API}.CONSUMER.DURABLE.CREATE.{stream}.{name}",
            f"{API}.CONSUMER.INFO.{stream}.{name}", f"{API}.CONSUMER.MSG.NEXT.{stream}.{name}",
            f"$JS.ACK.{stream}.{name}.>"]


def bind_agent(subject: str, agent_id: str) -> str:
    """A contract wildcard whose last token is the agent id, narrowed to one agent."""
    head, _, last = subject.rpartition(".")
    if last != "*":
        raise ValueError(f"{subject!r} has no agent token to bind")
    return f"{head}.{agent_id}"


def all_durables(tracker_partitions: int = 1) -> dict[str, list[str]]:
    """Every durable some service consumes, by stream."""
    out: dict[str, list[str]] = {}
    for access in GRANTS.values():
        for c in access.consume:
            out.setdefault(c.stream, []).extend(_durables(c, tracker_partitions))
    return out


def _uniq(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def permissions(access: BusAccess, user: str, *, agent_id: str | None = None,
                tracker_partitions: int = 1) -> dict[str, Any]:
    """The server's ``permissions`` block for ``user`` holding ``access``."""
    if access.per_agent and agent_id is None:
        raise ValueError("a per-agent grant needs the agent id")
    publish = list(access.publish)
    serve = list(access.serve)
    if access.per_agent and agent_id is not None:
        publish = [bind_agent(s, agent_id) for s in publish]
        serve = [bind_agent(s, agent_id) for s in serve]
    deny: list[str] = []
    if access.declare_streams or access.monitor or access.consume or access.read \
            or access.object_stores:
        publish.append(f"{API}.INFO")
    if access.declare_streams:
        publish += [f"{API}.STREAM.{op}.{s}" for s in STREAMS for op in ("CREATE", "UPDATE",
                                                                          "INFO")]
    for c in access.consume:
        for name in _durables(c, tracker_partitions):
            publish += _consumer_subjects(c.stream, name)
        publish.append(Subjects.dead_letter(c.stream))
    if access.read:
        taken = all_durables(tracker_partitions)
        for stream in access.read:
            publish += [f"{API}.CONSUMER.CREATE.{stream}.*", f"{API}.CONSUMER.CREATE.{stream}.*.>",
                        f"{API}.CONSUMER.INFO.{stream}.*", f"{API}.CONSUMER.MSG.NEXT.{stream}.*",
                        f"{API}.CONSUMER.DELETE.{stream}.*"]
            mine = {n for c in access.consume if c.stream == stream
                    for n in _durables(c, tracker_partitions)}
            for name in taken.get(stream, []):
                if name not in mine:
                    deny += [*_consumer_subjects(stream, name),
                             f"{API}.CONSUMER.DELETE.{stream}.{name}"]
    for bucket in access.object_stores:
        obj = f"OBJ_{bucket}"
        # UPDATE: an existing bucket is brought to its owner's limits; NAMES: nats-py looks the
        # bucket's stream up by subject to read an object back (names only, of every stream).
        publish += [f"{API}.STREAM.{op}.{obj}" for op in ("CREATE", "INFO", "UPDATE", "PURGE")]
        publish.append(f"{API}.STREAM.NAMES")
        publish += [f"{API}.STREAM.MSG.GET.{obj}", f"{API}.DIRECT.GET.{obj}",
                    f"{API}.DIRECT.GET.{obj}.>", f"{API}.CONSUMER.CREATE.{obj}",
                    f"{API}.CONSUMER.CREATE.{obj}.>", f"{API}.CONSUMER.INFO.{obj}.*",
                    f"{API}.CONSUMER.DELETE.{obj}.*", f"{API}.CONSUMER.MSG.NEXT.{obj}.*",
                    f"$O.{bucket}.>", f"$JS.ACK.{obj}.>", f"$JS.FC.{obj}.>"]
    if access.monitor:
        publish += [f"{API}.STREAM.INFO.{s}" for s in STREAMS]
        publish += [f"{API}.CONSUMER.LIST.{s}" for s in STREAMS]
        publish += [f"{API}.CONSUMER.NAMES.{s}" for s in STREAMS]
    block: dict[str, Any] = {
        "publish": {"allow": _uniq(publish)},
        "subscribe": {"allow": _uniq([*serve, f"{inbox_prefix(user)}.>"])},
    }
    if deny:
        block["publish"]["deny"] = _uniq(deny)
    if serve:
        block["allow_responses"] = True
    return block


def service_users(*, agents: Iterable[str] = (), tracker_partitions: int = 1,
                  grants: Mapping[str, BusAccess] = GRANTS) -> dict[str, dict[str, Any]]:
    """Every bus user (by name) with its permissions: one per central service, one per agent
    id in ``agents``."""
    out: dict[str, dict[str, Any]] = {}
    for name, access in grants.items():
        if access.per_agent:
            for agent in agents:
                user = agent_user(agent)
                out[user] = permissions(access, user, agent_id=agent,
                                        tracker_partitions=tracker_partitions)
        else:
            out[name] = permissions(access, name, tracker_partitions=tracker_partitions)
    return out


_ENV = re.compile(r'"@@env:([A-Za-z_][A-Za-z0-9_]*)@@"')


def render_authorization(users: Mapping[str, dict[str, Any]],
                         passwords: Mapping[str, Password]) -> str:
    """The ``authorization`` block of a nats-server config (its syntax takes JSON, plus
    ``$VAR`` references for passwords read from the server's environment); a user without a
    password is an error, not an open door."""
    missing = sorted(set(users) - set(passwords))
    if missing:
        raise ValueError(f"no password for bus user(s) {missing}")
    entries = []
    for name, perms in users.items():
        pw = passwords[name]
        entries.append({"user": name,
                        "password": f"@@env:{pw.name}@@" if isinstance(pw, EnvRef) else pw,
                        "permissions": perms})
    body = json.dumps({"users": entries}, indent=2)
    return "authorization " + _ENV.sub(lambda m: f"${m.group(1)}", body) + "\n"
