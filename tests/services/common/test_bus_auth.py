"""The embedded NATS admits only the registry's users, each with exactly its line's rights.

Every central service connects as itself and does what it does on start (declare the streams,
bind its durables, publish its subjects); the server refuses what its line does not grant, and a
connection without or with wrong credentials fails at once with a clear error instead of
retrying forever. An agent publishes and serves for its own agent id only.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError

from services.common.bus.auth import BusAuthError, Credentials, agent_user
from services.common.bus.client import Consumer, connect, ensure_streams
from services.common.bus.contract import IterationBatch, Subjects
from services.common.bus.permissions import _durables
from services.common.bus.refusals import PermissionDenied
from services.common.bus.streams import (
    ANALYZER,
    ANALYZER_COLLECTIVES,
    EVENTS,
    PLANNER,
    TELEMETRY,
    TRACKER,
    VALIDATOR,
    ConsumerSpec,
    tracker_spec,
)
from services.common.embedded import EmbeddedNats
from services.common.runtime import Backends, start_service
from services.common.settings import Settings
from services.registry import BY_NAME, SERVICES, Service

CENTRAL = [s for s in SERVICES if not s.bus.per_agent]
# What a refused publish or request looks like to the sender: the server drops it and says why,
# and the connection turns the request's timeout into that reason, a permanent error.
REFUSED = PermissionDenied


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(tmp_path_factory.mktemp("auth"))
    server.start()
    yield server
    server.stop()


def _settings(server: EmbeddedNats) -> Settings:
    return Settings(nats_url=server.url, data_dir=server.data_dir)


async def _as(server: EmbeddedNats, user: str) -> NATS:
    return await connect(server.url, name=f"test-{user}", credentials=server.credentials(user))


async def _stored(nc: NATS, stream: str, subject: str) -> int:
    """How many messages the stream holds on ``subject`` (the API's monitoring right)."""
    info = await nc.jetstream().stream_info(stream, subjects_filter=subject)
    return int((info.state.subjects or {}).get(subject, 0))


def test_files_with_secrets_are_private(secure: EmbeddedNats) -> None:
    for name in ("users.json", "server.conf"):
        mode = (secure.data_dir / "nats" / name).stat().st_mode & 0o777
        assert mode == 0o600, f"{name} has mode {oct(mode)}"
    assert "authorization" in (secure.data_dir / "nats" / "server.conf").read_text()


async def test_no_or_wrong_credentials_fail_at_once_with_a_clear_error(
        secure: EmbeddedNats) -> None:
    right = secure.credentials("tracker")
    for creds in (None, Credentials("tracker", "not-the-password"), Credentials("nobody", "x")):
        t0 = time.monotonic()
        with pytest.raises(BusAuthError, match="GREYHOUND_NATS_USER") as err:
            await asyncio.wait_for(connect(secure.url, name="test-bad", credentials=creds), 30)
        assert time.monotonic() - t0 < 10, "a refused login must not be retried"
        assert right.password not in str(err.value)
    nc = await connect(secure.url, name="test-good", credentials=right)
    assert nc.is_connected
    await nc.close()


async def test_a_service_without_credentials_does_not_start(secure: EmbeddedNats) -> None:
    with pytest.raises(BusAuthError):
        await asyncio.wait_for(start_service(
            "tracker", _settings(secure), need_db=False,
            backends=Backends(nats_url=secure.url, database_url="")), 30)


@pytest.mark.parametrize("svc", CENTRAL, ids=lambda s: s.name)
async def test_each_service_does_its_own_work_and_nothing_else(
        secure: EmbeddedNats, svc: Service) -> None:
    settings = _settings(secure)
    ctx = await start_service(svc.name, settings, need_db=False, backends=Backends(
        nats_url=secure.url, database_url="", nats_credentials=secure.credentials(svc.name)))
    try:
        for c in svc.bus.consume:  # bind each durable as the service's Consumer does
            for durable in _durables(c, settings.tracker_partitions):
                spec = ConsumerSpec(stream=c.stream, durable=durable,
                                    filter_subjects=(_filter(c.stream, durable),))
                consumer: Consumer[IterationBatch] = Consumer(ctx.js, spec, IterationBatch,
                                                              _noop, bind_timeout_s=5)
                sub = await consumer.bind()
                await sub.unsubscribe()
                await ctx.js.consumer_info(c.stream, durable)
        job = f"perm{uuid.uuid4().hex[:8]}"
        granted = {Subjects.ALL_DETECTIONS: Subjects.detection(job),
                   Subjects.ALL_INCIDENTS: Subjects.incident(job),
                   Subjects.ALL_SUSPICIONS: Subjects.suspicion(job)}
        for wildcard, subject in granted.items():
            ack = ctx.js.publish(subject, b"{}", timeout=2 if wildcard in svc.bus.publish else 0.5)
            if wildcard in svc.bus.publish:
                await ack
            else:
                with pytest.raises(REFUSED):
                    await ack
        with pytest.raises(REFUSED):  # nobody but the agents sends telemetry
            await ctx.js.publish(Subjects.iterations(job, "n1"), b"{}", timeout=0.5)
    finally:
        await ctx.close()


def _filter(stream: str, durable: str) -> str:
    """A filter inside the durable's real one, so binding does not change its meaning."""
    for spec in (TRACKER, ANALYZER, VALIDATOR, ANALYZER_COLLECTIVES):
        if spec.stream == stream and spec.durable == durable:
            return spec.filter_subjects[0]
    return Subjects.ALL_INCIDENTS if stream == EVENTS else Subjects.ALL_ITERATIONS


async def _noop(_subject: str, _msg: IterationBatch) -> None:
    return None


async def test_an_agent_publishes_and_serves_for_its_own_id_only(secure: EmbeddedNats) -> None:
    admin = await _as(secure, "api")  # reads streams: checks what was stored
    tracker = await _as(secure, "tracker")
    await ensure_streams(tracker.jetstream(), _settings(secure))
    n1 = await _as(secure, agent_user("n1"))
    job = f"agent{uuid.uuid4().hex[:8]}"
    try:
        js = n1.jetstream()
        own = IterationBatch(job_id=job, agent_id="n1", rank=[0], iteration=[1], end_ns=[1],
                             duration_s=[0.1])
        await js.publish(Subjects.iterations(job, "n1"), own.model_dump_json().encode())
        with pytest.raises(REFUSED):
            await js.publish(Subjects.iterations(job, "n2"), own.model_dump_json().encode(),
                             timeout=0.5)
        for forged in (Subjects.suspicion(job), Subjects.detection(job)):
            with pytest.raises(REFUSED):
                await js.publish(forged, b"{}", timeout=0.5)
        assert await _stored(admin, TELEMETRY, Subjects.iterations(job, "n1")) == 1
        assert await _stored(admin, TELEMETRY, Subjects.iterations(job, "n2")) == 0
        assert await _stored(admin, EVENTS, Subjects.suspicion(job)) == 0

        # Another node's control: the server refuses the subscription; a request the
        # validator sends there reaches no one.
        got: list[bytes] = []

        async def spy(msg: object) -> None:
            got.append(getattr(msg, "data", b""))

        await n1.subscribe(Subjects.control(job, "n2"), cb=spy)
        await n1.subscribe(Subjects.validation(job, "n2"), cb=spy)
        await n1.flush()
        validator = await _as(secure, "validator")
        for subject in (Subjects.control(job, "n2"), Subjects.validation(job, "n2")):
            with pytest.raises(NoRespondersError):
                await validator.request(subject, b"{}", timeout=1)
        await asyncio.sleep(0.3)
        assert got == []
        await validator.close()
    finally:
        for nc in (n1, tracker, admin):
            await nc.close()


def test_partitioned_trackers_get_one_durable_each() -> None:
    tracker = BY_NAME["tracker"].bus.consume[0]
    assert _durables(tracker, 1) == ["tracker"]
    base = Settings(tracker_partitions=3)
    assert _durables(tracker, 3) == [
        tracker_spec(base.model_copy(update={"tracker_partition": i})).durable for i in range(3)]


async def test_the_api_reads_telemetry_but_cannot_touch_the_services_durables(
        secure: EmbeddedNats) -> None:
    from nats.js.errors import APIError

    from services.api.telemetry import read_window

    tracker = await _as(secure, "tracker")
    await ensure_streams(tracker.jetstream(), _settings(secure))
    await tracker.jetstream().add_consumer(TELEMETRY, TRACKER.config())  # the tracker's durable
    n1 = await _as(secure, agent_user("n1"))
    api = await _as(secure, "api")
    job = f"read{uuid.uuid4().hex[:8]}"
    try:
        batch = IterationBatch(job_id=job, agent_id="n1", rank=[0, 1], iteration=[1, 1],
                               end_ns=[1, 2], duration_s=[0.1, 0.1])
        await n1.jetstream().publish(Subjects.iterations(job, "n1"),
                                     batch.model_dump_json().encode())
        window = await read_window(api.jetstream(), job, window_s=60)
        assert [b.rank for b in window.iterations] == [[0, 1]]
        js = api.jetstream()
        with pytest.raises(REFUSED):  # no fetching the tracker's messages
            await api.request(f"$JS.API.CONSUMER.MSG.NEXT.{TELEMETRY}.{TRACKER.durable}",
                              b'{"batch": 1}', timeout=0.5)
        with pytest.raises((REFUSED, APIError)):
            await js.delete_consumer(TELEMETRY, TRACKER.durable)
        assert (await tracker.jetstream().consumer_info(TELEMETRY, TRACKER.durable)).name
    finally:
        for nc in (api, n1, tracker):
            await nc.close()


def test_the_registry_grants_the_durables_the_services_bind() -> None:
    from services.notifier.service import NOTIFIER

    bound = {"tracker": [TRACKER], "analyzer": [ANALYZER, ANALYZER_COLLECTIVES],
             "validator": [VALIDATOR], "planner": [PLANNER], "notifier": [NOTIFIER]}
    for name, specs in bound.items():
        granted = {(c.stream, c.durable) for c in BY_NAME[name].bus.consume}
        assert granted == {(s.stream, s.durable) for s in specs}, name
    assert not any(s.bus.consume for s in SERVICES if s.name not in bound)
