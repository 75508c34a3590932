"""At start each service checks that its bus user may do what its code does, and refuses to
start, naming the grant, when the server lacks one (services.common.bus.preflight):

* every service passes on the embedded NATS, whose users come from the registry;
* every grant the registry gives a service is one the check tries (so a server that lacks any of
  them is caught at start, not deep in a handler);
* a server without the tracker's stream lookup (what the tracker lacked: it could not read its
  saved state back) stops the tracker at start with a message naming it; the command exits with
  that message and no traceback;
* the check changes nothing: streams, durables (pending and unacked messages), the state bucket
  are as they were, and no probe consumer is left.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from nats.js import JetStreamContext

from services.common.bus import preflight
from services.common.bus.auth import agent_user
from services.common.bus.client import BusClient, ensure_streams, publish
from services.common.bus.contract import DetectionEvent, Subjects
from services.common.bus.permissions import permissions
from services.common.bus.streams import (
    ANALYZER,
    ANALYZER_COLLECTIVES,
    PLANNER,
    STREAMS,
    TELEMETRY,
    TRACKER,
    VALIDATOR,
)
from services.common.runtime import start_service
from services.common.settings import Settings
from services.notifier.service import NOTIFIER
from services.registry import SERVICES
from services.tracker.state_store import BUCKET, TrackerStateStore
from tests.conftest import Bus, new_bus
from tests.services.common.support import batch

AGENT = "pf-node"
# Granted, and not what the check tries, each for a reason:
UNCHECKED = {
    # nats-py's ways to bind a consumer with one filter subject, or without a name; ours are
    # named and have several
    "$JS.API.CONSUMER.CREATE.*.*.>": "filtered create form",
    "$JS.API.CONSUMER.DURABLE.CREATE.*.*": "legacy durable create form",
    "$JS.API.CONSUMER.CREATE.GH_TELEMETRY.*": "a reader without a filter (ours have one)",
    # ordered consumers of the state bucket ack nothing; the grant covers nats-py's other paths
    "$JS.ACK.OBJ_gh-tracker-state.>": "object store acks",
    "$JS.API.DIRECT.GET.OBJ_gh-tracker-state": "direct get (not used by nats-py's get)",
    "$JS.API.DIRECT.GET.OBJ_gh-tracker-state.>": "direct get (not used by nats-py's get)",
    "$JS.API.CONSUMER.INFO.OBJ_gh-tracker-state.*": "ordered consumer info",
    "$JS.API.CONSUMER.DELETE.OBJ_gh-tracker-state.*": "ordered consumer delete",
    "$JS.API.CONSUMER.MSG.NEXT.OBJ_gh-tracker-state.*": "pull from the bucket (not used)",
    "$JS.API.CONSUMER.CREATE.OBJ_gh-tracker-state.>": "filtered create form",
    "$JS.API.STREAM.INFO.GH_TELEMETRY": "declared streams: the info grant goes with them",
    "$JS.API.STREAM.INFO.GH_EVENTS": "declared streams: the info grant goes with them",
    "$JS.API.STREAM.INFO.GH_PLANS": "declared streams: the info grant goes with them",
    "$JS.API.STREAM.INFO.GH_DLQ": "declared streams: the info grant goes with them",
    "$JS.API.INFO": "account info: given to every JetStream user",
}


def _matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` one token, ``>`` the rest."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok.lower() != s[i].lower()):
            return False
    return len(p) == len(s)


def _generalise(pattern: str) -> str:
    """A grant with its consumer name as a wildcard, the way UNCHECKED names them."""
    parts = pattern.split(".")
    if pattern.startswith("$JS.API.CONSUMER.CREATE.") and len(parts) > 6 and parts[-1] == ">":
        return ".".join([*parts[:4], "*", "*", ">"])
    if pattern.startswith("$JS.API.CONSUMER.DURABLE.CREATE.") and len(parts) == 7:
        return ".".join([*parts[:5], "*", "*"])
    return pattern


@pytest.mark.parametrize("service", SERVICES, ids=lambda s: s.name)
def test_every_grant_is_one_the_check_tries(service: Any) -> None:
    agent = AGENT if service.bus.per_agent else None
    user = service.bus_user({"agent_id": AGENT})
    block = permissions(service.bus, user, agent_id=agent)
    tried = preflight.needs(service.bus, Settings(), agent)
    publishes = [n.subject for n in tried if n.how != "subscribe"]
    declared = [f"$JS.API.STREAM.CREATE.{s}" for s in STREAMS] if service.bus.declare_streams else []
    unchecked = []
    for grant in block["publish"]["allow"]:
        if any(_matches(grant, subject) for subject in publishes):
            continue
        if grant not in UNCHECKED and _generalise(grant) not in UNCHECKED and grant not in declared:
            unchecked.append(grant)
    assert unchecked == [], f"{service.name}: granted, never checked at start: {unchecked}"
    serves = [n.subject for n in tried if n.how == "subscribe"]
    for grant in block["subscribe"]["allow"]:
        if grant.startswith("_GH_INBOX."):
            continue  # every request of the check uses the reply inbox
        assert any(_matches(grant, subject) for subject in serves), (service.name, grant)


async def test_every_service_passes_on_the_bus_its_registry_makes(own_bus: Bus) -> None:
    for service in SERVICES:
        nc = await own_bus.connect(service.bus_user({"agent_id": AGENT}))
        t0 = time.monotonic()
        try:
            await preflight.check(nc, nc.jetstream(), service.name, service.bus, Settings())
        finally:
            await nc.close()
        assert time.monotonic() - t0 < preflight.TIMEOUT_S, service.name  # nothing waited out


async def test_a_missing_grant_stops_the_start_naming_it(tmp_path: Path) -> None:
    with new_bus("gh-pf-") as bus:
        bus.withdraw("tracker", "$JS.API.STREAM.NAMES")
        t0 = time.monotonic()
        with pytest.raises(preflight.MissingGrants) as err:
            await start_service("tracker", Settings(nats_url=bus.url, data_dir=tmp_path),
                                need_db=False, backends=bus.backends("tracker"))
        took = time.monotonic() - t0
    text = str(err.value)
    assert "bus user 'tracker'" in text and "publish to $JS.API.STREAM.NAMES" in text, text
    assert "object store 'gh-tracker-state'" in text and "server_config" in text, text
    assert [n.subject for n in err.value.missing] == ["$JS.API.STREAM.NAMES"]
    assert took < 3 * preflight.TIMEOUT_S, took  # the probes wait together, once


def test_the_command_refuses_to_start_with_one_message(tmp_path: Path) -> None:
    with new_bus("gh-pf-cli-") as bus:
        bus.withdraw("tracker", "$JS.API.STREAM.NAMES")
        creds = bus.creds("tracker")
        env = dict(os.environ, GREYHOUND_NATS_URL=bus.url, GREYHOUND_NATS_USER=creds.user,
                   GREYHOUND_NATS_PASSWORD=creds.password, GREYHOUND_DATA_DIR=str(tmp_path),
                   # never reached: the bus check comes first
                   GREYHOUND_DATABASE_URL="postgresql://127.0.0.1:9/nowhere")
        done = subprocess.run([sys.executable, "-m", "stack.cli", "tracker"], env=env,
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "tracker cannot start" in done.stderr and "$JS.API.STREAM.NAMES" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-2000:]


async def _state(js: JetStreamContext) -> dict[str, Any]:
    """Everything the check could have touched: each stream's messages, each consumer's
    positions, the state bucket's object."""
    out: dict[str, Any] = {}
    for name in (*STREAMS, f"OBJ_{BUCKET}"):
        info = await js.stream_info(name)
        out[name] = (info.state.messages, info.state.first_seq, info.state.last_seq)
        out[f"{name} consumers"] = sorted(
            (c.name, c.delivered and c.delivered.stream_seq, c.ack_floor and c.ack_floor.stream_seq,
             c.num_pending, c.num_ack_pending, c.num_redelivered)
            for c in await js.consumers_info(name))
    return out


async def test_the_check_changes_nothing(own_bus: Bus) -> None:
    operator = await own_bus.connect()
    agent = await own_bus.connect(agent_user(AGENT))
    tracker = await own_bus.connect("tracker")
    js = operator.jetstream()
    try:
        await ensure_streams(js, Settings())
        for i in range(3):  # telemetry and events waiting for each durable
            await publish(agent.jetstream(), Subjects.iterations("pf-job", AGENT),
                          batch("pf-job", i).model_copy(update={"agent_id": AGENT}))
            await publish(tracker.jetstream(), Subjects.detection("pf-job"), DetectionEvent(
                job_id="pf-job", kind="slowdown", ranks=[0], first_iteration=1,
                detected_iteration=2, before_s=0.1, after_s=0.2, detected_ns=i))
        for spec in (TRACKER, ANALYZER, ANALYZER_COLLECTIVES, VALIDATOR, PLANNER, NOTIFIER):
            await js.add_consumer(spec.stream, spec.config())
        sub = await js.pull_subscribe_bind(TRACKER.durable, stream=TELEMETRY)
        (held,) = await sub.fetch(1, timeout=5)  # delivered, not acked: an ack would show
        store = await TrackerStateStore(tracker.jetstream()).open()
        await store.save("pf-job", {"kept": True})
        before = await _state(js)
        for service in SERVICES:
            nc: BusClient = await own_bus.connect(service.bus_user({"agent_id": AGENT}))
            try:
                await preflight.check(nc, nc.jetstream(), service.name, service.bus, Settings())
            finally:
                await nc.close()
        assert await _state(js) == before
        assert await store.load("pf-job") == {"kept": True}
        assert held.metadata.num_delivered == 1
        await sub.unsubscribe()
    finally:
        for nc in (agent, tracker, operator):
            await nc.close()

