"""Connecting to NATS, publishing contract messages, and the durable consumer loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NotJSMessageError
from nats.js import JetStreamContext
from nats.js.api import StreamConfig, StreamInfo
from nats.js.errors import BadRequestError, NotFoundError
from pydantic import BaseModel, TypeAdapter, ValidationError

from services.common.bus.auth import BusAuthError, Credentials
from services.common.bus.contract import Message, Subjects, subject_mismatch
from services.common.bus.dead_letters import encode_dead_letter
from services.common.bus.errors import PermanentError, TransientError, classify, describe
from services.common.bus.holds import Holds
from services.common.bus.refusals import PermissionDenied, Refusal, Refusals
from services.common.bus.streams import (
    ConsumerSpec,
    StreamMismatch,
    stream_configs,
    stream_mismatches,
)
from services.common.redact import redact
from services.common.settings import Settings, nats_servers

__all__ = ["BusAuthError", "BusClient", "Consumer", "ConsumerLost", "ConsumerStats",
           "PermanentError", "PermissionDenied", "StreamMismatch", "StreamPlacementError",
           "TransientError",
           "check_streams", "connect", "ensure_streams", "publish", "shown"]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

FETCH_WAIT_S = 0.25
# A permanent fetch error this many times in a row means the subscription is unusable.
PERMANENT_FETCH_LIMIT = 3
MAX_PAUSE_S = 5.0
# While the consumer's dependency is away: how often it is asked again (doubling up to the
# most), how long one question may take, and when the messages fetched meanwhile come back.
AWAY_PROBE_S = 0.5
MAX_AWAY_PROBE_S = 10.0
READY_TIMEOUT_S = 5.0
AWAY_NAK_S = 1.0
MAX_STRIKES_KEPT = 10_000


_AUTH_ERRORS = ("authorization violation", "authentication", "user authentication expired",
                "account authentication expired")
_PERMISSION_LOG_LIMIT = 20


def _auth_failure(exc: BaseException) -> bool:
    return isinstance(exc, nats.errors.AuthorizationError) or (
        isinstance(exc, nats.errors.Error) and any(k in str(exc).lower() for k in _AUTH_ERRORS))


class BusClient(NATS):
    """nats-py's client that knows what the server refused it (services.common.bus.refusals):
    a request that gets no answer because its subject (or this user's reply inbox) was refused
    raises PermissionDenied, a permanent error, instead of a timeout that would be retried."""

    def __init__(self, user: str | None = None, inbox: str = "_INBOX") -> None:
        super().__init__()
        self.bus_user = user
        self.inbox = inbox
        self.refusals = Refusals()

    def refused_since(self, t: float, subject: str) -> Refusal | None:
        """What the server refused since ``t`` (monotonic) that a request on ``subject`` needs:
        publishing there, or hearing the answer in this user's inbox."""
        return (self.refusals.since(t, subject)
                or self.refusals.any_since(t, f"{self.inbox}.", action="subscribe"))

    async def request(self, subject: str, payload: bytes = b"", timeout: float = 0.5,
                      old_style: bool = False, headers: dict[str, Any] | None = None) -> Msg:
        t = time.monotonic()
        try:
            return await super().request(subject, payload, timeout=timeout, old_style=old_style,
                                         headers=headers)
        except nats.errors.TimeoutError as exc:
            refused = self.refused_since(t, subject)
            if refused is None:
                raise
            raise PermissionDenied(refused, self.bus_user) from exc


def shown(url: str) -> str:
    """A GREYHOUND_NATS_URL (one URL or a list) as a log line may show it: no passwords."""
    return ",".join(redact(u) for u in nats_servers(url))


async def connect(url: str, *, name: str, credentials: Credentials | None = None,
                  tls: ssl.SSLContext | None = None) -> BusClient:
    """Connect with endless reconnects: a bus restart must not kill a service or an agent.

    ``url`` is one server or a comma-separated list of a cluster's (nats-py's ``servers``):
    the client connects to one of them, learns the cluster's other servers from it, and moves
    to another when its server goes away.

    A server that refuses the credentials on the first connect (none given where it needs
    some, a wrong password), or a TLS handshake that fails (an untrusted certificate, no client
    certificate where the server wants one), raises BusAuthError at once: nats-py would retry
    forever, and a service stuck there looks alive while doing nothing. Permission violations
    later on (a subject this user may not use) are logged as errors, the first few of each, and
    recorded on the connection (BusClient.refusals) so that what they cause fails for good.
    """
    nc = BusClient(credentials.user if credentials else None,
                   credentials.inbox_prefix if credentials else "_INBOX")
    connected = False
    violations: dict[str, int] = {}
    who = f"user {credentials.user!r}" if credentials else "a connection without credentials"

    async def on_error(exc: Exception) -> None:
        if not connected and _auth_failure(exc):
            raise BusAuthError(f"NATS at {shown(url)} refused {who} ({name}): {exc}. Set "
                               "GREYHOUND_NATS_USER and GREYHOUND_NATS_PASSWORD to this "
                               "process's bus user (see docs/security.md)") from exc
        if not connected and isinstance(exc, ssl.SSLError):
            raise BusAuthError(f"TLS with NATS at {shown(url)} failed ({name}): {exc}. Check "
                               "GREYHOUND_NATS_TLS_CA (and _CERT/_KEY when the server verifies "
                               "clients); see docs/security.md") from exc
        text = str(exc)
        if nc.refusals.record(text) is not None:
            if text not in violations and len(violations) >= 1000:
                return  # counted per subject, for a bounded number of subjects
            n = violations[text] = violations.get(text, 0) + 1
            if n <= _PERMISSION_LOG_LIMIT:
                log.error("%s (%s as %s): the server's permissions refused it", text, name, who)
            return
        log.warning("nats (%s): %s", name, describe(exc))

    # endless reconnects, half a second apart
    options: dict[str, Any] = {"max_reconnect_attempts": -1, "reconnect_time_wait": 0.5}
    if credentials is not None:
        options.update(user=credentials.user, password=credentials.password,
                       inbox_prefix=credentials.inbox_prefix)
    if tls is not None:
        options["tls"] = tls
    try:
        await nc.connect(servers=nats_servers(url), name=name, allow_reconnect=True, connect_timeout=5,
                         error_cb=on_error, **options)
    except BaseException:
        with contextlib.suppress(Exception):  # a half-done TLS handshake can hang close()
            await asyncio.wait_for(nc.close(), 2.0)
        raise
    connected = True
    return nc


def _named(cfg: StreamConfig) -> str:
    if not cfg.name:
        raise ValueError("a stream configuration without a name")
    return cfg.name


# JetStream's "no suitable peers for placement": a cluster's meta leader, just elected, has not
# yet heard from enough servers to place a stream's replicas (a node still starting, or down).
NO_PEERS_ERR_CODE = 10005
# How long a stream's creation waits for its peers: a cluster forming on a loaded machine
# takes seconds; past this, a missing node is the operator's to see.
PLACEMENT_WAIT_S = 60.0
PLACEMENT_RETRY_S = 0.5


class StreamPlacementError(RuntimeError):
    """The cluster could not place a stream's replicas within PLACEMENT_WAIT_S."""


async def _add_stream(js: JetStreamContext, cfg: StreamConfig,
                      wait_s: float = PLACEMENT_WAIT_S) -> BadRequestError | None:
    """Create the stream: None; the server's refusal where it refused it, as existing (made
    meanwhile by another process, compared by the caller) or otherwise (_made_meanwhile).
    A refusal for want of peers is waited out, since a forming cluster gives it before it
    gives anything else: read as "made meanwhile" it left a stream that was never made (a CI
    run's `streams apply` on a cluster just up)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            await js.add_stream(cfg)
            return None
        except BadRequestError as e:
            if e.err_code != NO_PEERS_ERR_CODE:
                return e
            if time.monotonic() >= deadline:
                raise StreamPlacementError(
                    f"stream {cfg.name}: the cluster found no servers for its "
                    f"{cfg.num_replicas} replicas within {wait_s:.0f} s ({e.description}); "
                    "are all its nodes up and routed?") from e
            log.info("stream %s: waiting for the cluster's peers (%s)", cfg.name, e.description)
            await asyncio.sleep(PLACEMENT_RETRY_S)


async def _made_meanwhile(js: JetStreamContext, name: str,
                          refusal: BadRequestError) -> StreamInfo:
    """The stream info of a stream whose creation was refused as existing; the refusal itself
    where it does not exist after all (refused for another reason)."""
    try:
        return await js.stream_info(name)
    except NotFoundError:
        raise refusal from None


async def ensure_stream(js: JetStreamContext, cfg: StreamConfig) -> str:
    """Create the stream, or update it to ``cfg`` where it exists with another configuration;
    what was done ("created", "updated", "unchanged"). ``greyhound streams apply`` does this,
    once, on purpose; a service only checks (check_stream)."""
    name = _named(cfg)
    try:
        have = (await js.stream_info(name)).config
    except NotFoundError:
        refusal = await _add_stream(js, cfg)
        if refusal is None:
            return "created"
        have = (await _made_meanwhile(js, name, refusal)).config
    if not stream_mismatches(cfg, have):
        return "unchanged"
    await js.update_stream(cfg)
    return "updated"


async def ensure_streams(js: JetStreamContext, settings: Settings) -> dict[str, str]:
    """Create or update every stream (ensure_stream): what was done to each, by name."""
    return {_named(cfg): await ensure_stream(js, cfg) for cfg in stream_configs(settings)}


async def check_stream(js: JetStreamContext, cfg: StreamConfig) -> None:
    """Create the stream where there is none; raise StreamMismatch where it exists otherwise
    than ``cfg`` says, never changing it (what a service does on start)."""
    name = _named(cfg)
    try:
        have = (await js.stream_info(name)).config
    except NotFoundError:
        refusal = await _add_stream(js, cfg)  # the same config made meanwhile is no error
        if refusal is None:
            return
        have = (await _made_meanwhile(js, name, refusal)).config  # otherwise: compared below
    differences = stream_mismatches(cfg, have)
    if differences:
        raise StreamMismatch(name, differences)


async def check_streams(js: JetStreamContext, settings: Settings) -> None:
    """check_stream for every stream."""
    for cfg in stream_configs(settings):
        await check_stream(js, cfg)


async def publish(js: JetStreamContext, subject: str, msg: Message) -> None:
    """Publish with the event id as Nats-Msg-Id so a retried publish is stored once."""
    await js.publish(subject, msg.model_dump_json().encode(), headers={"Nats-Msg-Id": msg.event_id})


@dataclass
class ConsumerStats:
    """What a consumer did, and every failure it absorbed instead of dying silently."""

    handled: int = 0
    elsewhere: int = 0  # acked unread: another partition's job
    dead_lettered: int = 0
    retried: int = 0
    held: int = 0  # naked unhandled: their job waited behind a message that had failed
    paused: int = 0  # times fetching paused because the dependency (the database) was away
    paused_s: float = 0.0
    reasons: dict[str, int] = field(default_factory=dict)
    fetch_failures: int = 0
    settle_failures: int = 0  # ack, nak or term that did not reach the server
    idle_failures: int = 0
    handle_failures: int = 0  # handle() itself raised (outside the handler)
    dead_letter_failures: int = 0


class ConsumerLost(RuntimeError):
    """The consumer cannot go on: its durable or stream is gone, or the connection is closed.

    Raised out of Consumer.run so the service's main task ends and the process exits; its
    supervisor restarts it, and the new process recreates streams and the consumer.
    """


Handler = Callable[[str, M], Awaitable[None]]


def _delivery(msg: Msg) -> int:
    """Which delivery of the message this is (1 = first); 1 when the server did not say."""
    try:
        return int(msg.metadata.num_delivered)
    except (NotJSMessageError, ValueError, IndexError):
        return 1


def stream_seq(msg: Msg) -> int | None:
    """The message's sequence in its stream; None when the server did not say."""
    try:
        return int(msg.metadata.sequence.stream)
    except (NotJSMessageError, ValueError, IndexError, AttributeError):
        return None


class Consumer(Generic[M]):
    """A durable pull consumer that validates each message against the contract.

    Each message ends one way: acked after the handler returned (i.e. after its database
    commit); naked with the spec's retry delay after a transient failure (see errors.classify);
    or terminated and recorded on the dead-letter subject with the reason, when it fails
    validation, says another job or agent than its subject (contract.subject_mismatch: the
    server checks the subject, not the body), fails its handler for good, or fails transiently
    ``max_deliver`` times while its dependency answers.

    A transient failure while the dependency is away (``ready``, the service's database probe,
    says so: down, or read-only after a failover) is no fault of the message: it never counts
    towards that bound, and fetching pauses, asking ``ready`` again with a growing interval,
    until the dependency is back; the messages fetched meanwhile go back unhandled. The server
    redelivers without a bound (max deliver -1), so an outage of any length loses nothing.

    One job's trouble stays its own (services.common.bus.holds): after a transient failure the
    job's later messages wait behind the failed one, naked without running the handler, while
    the other jobs go on; on its last delivery a message runs whatever it waits behind.

    A partitioned consumer (``jobs``: whether a job is its partition's) acks the messages of
    other jobs unread: they are another partition's durable's to handle.

    Nothing escapes run() silently: failures to fetch, settle a message or run ``idle`` are
    logged and counted in ``stats`` and consumption goes on; only a consumer that cannot go on
    (ConsumerLost: among others, the server refusing this user the fetch or the ack) ends run()
    with an exception.
    """

    def __init__(self, js: JetStreamContext, spec: ConsumerSpec, model: Any,
                 handler: Callable[[str, Any], Awaitable[None]], *,
                 liveness_s: float = 5.0, bind_timeout_s: float = 30.0,
                 ready: Callable[[], Awaitable[bool]] | None = None,
                 jobs: Callable[[str], bool] | None = None) -> None:
        self._js = js
        self._jobs = jobs
        self.spec = spec
        self._adapter: TypeAdapter[Any] = TypeAdapter(model)
        self._handler = handler
        self._liveness_s = liveness_s
        self._bind_timeout_s = bind_timeout_s
        self.stats = ConsumerStats()
        self._stopping = asyncio.Event()
        self._fetch_streak = 0
        self._idle_streak = 0
        self._checked_at = 0.0
        self.holds = Holds()
        self._ready = ready
        self._away = False  # the dependency was away at the last transient failure
        self._strikes: dict[int, int] = {}  # stream seq -> transient failures while it answered

    @property
    def _nc(self) -> NATS:
        return self._js._nc

    async def bind(self) -> Any:
        """Create the durable, or update it to the spec (the server creates or updates)."""
        await self._js.add_consumer(self.spec.stream, self.spec.config())
        return await self._js.pull_subscribe_bind(self.spec.durable, stream=self.spec.stream)

    # -- settling messages -------------------------------------------------------------------

    async def _settle(self, msg: Msg, how: Literal["ack", "nak", "term"],
                      delay: float | None = None) -> None:
        """Ack, nak or term; a failure is counted, not raised: the server redelivers the message
        after the ack wait, and handlers are idempotent."""
        try:
            if how == "ack":
                await msg.ack()
            elif how == "nak":
                await msg.nak(delay=delay)
            else:
                await msg.term()
        except Exception as exc:
            self.stats.settle_failures += 1
            log.warning("%s of %s on %s failed (redelivered after %.0fs ack wait): %s",
                        how, msg.subject, self.spec.durable, self.spec.ack_wait_s, describe(exc))

    def _letter_id(self, msg: Msg) -> dict[str, str] | None:
        """Nats-Msg-Id of the dead letter, so a message dead-lettered twice is stored once."""
        seq = stream_seq(msg)
        if seq is None:
            return None
        return {"Nats-Msg-Id": f"dlq.{self.spec.stream}.{self.spec.durable}.{seq}"}

    async def _dead_letter(self, msg: Msg, reason: str) -> None:
        key = reason.split(":", 1)[0]
        data = encode_dead_letter(stream=self.spec.stream, consumer=self.spec.durable,
                                  subject=msg.subject, reason=reason, data=msg.data,
                                  max_payload=self._nc.max_payload)
        try:
            await self._js.publish(Subjects.dead_letter(self.spec.stream), data,
                                   headers=self._letter_id(msg))
        except Exception as exc:  # keep it: dead-letter it when it comes back
            self.stats.dead_letter_failures += 1
            log.warning("could not dead-letter %s on %s (%s); it comes back for another try",
                        msg.subject, self.spec.durable, describe(exc))
            await self._settle(msg, "nak", self.spec.retry_delay_s(_delivery(msg)))
            return
        else:
            self.stats.dead_lettered += 1
            self.stats.reasons[key] = self.stats.reasons.get(key, 0) + 1
            log.warning("dead-lettered %s on %s: %s", msg.subject, self.spec.durable, reason[:200])
        await self._settle(msg, "term")

    async def _is_ready(self) -> bool:
        """Whether the dependency answers (always, for a consumer without one)."""
        if self._ready is None:
            return True
        try:
            return bool(await asyncio.wait_for(self._ready(), READY_TIMEOUT_S))
        except Exception as exc:
            log.debug("readiness probe of %s failed: %s", self.spec.durable, describe(exc))
            return False

    def _strike(self, msg: Msg, away: bool) -> int:
        """The message's tries while its dependency answered (a transient failure, or a turn
        spent waiting behind its job's failed message), this one included unless it was
        ``away``; the server's delivery count for a message without a sequence."""
        seq = stream_seq(msg)
        if seq is None:
            return _delivery(msg)
        strikes = self._strikes.pop(seq, 0) + (0 if away else 1)
        if len(self._strikes) < MAX_STRIKES_KEPT:
            self._strikes[seq] = strikes
        return strikes

    async def _failed(self, msg: Msg, exc: Exception) -> None:
        """A handler raised: dead-letter what no retry can fix, retry the rest (see the class
        docstring: a failure while the dependency is away never counts)."""
        seq = stream_seq(msg)
        if classify(exc) == "permanent":
            self.holds.release(msg.subject, seq)
            self._strikes.pop(seq or 0, None)
            if isinstance(exc, PermissionDenied):
                log.error("handler failed on %s: %s", msg.subject, exc)
            else:
                log.error("handler failed on %s", msg.subject, exc_info=exc)
            await self._dead_letter(msg, f"handler_error: {describe(exc)}")
            return
        away = not await self._is_ready()
        strikes = self._strike(msg, away)
        if strikes >= self.spec.max_deliver:
            self.holds.release(msg.subject, seq)
            self._strikes.pop(seq or 0, None)
            await self._dead_letter(msg, f"retries_exhausted: {strikes} tries of "
                                         f"{self.spec.max_deliver} while its dependencies "
                                         f"answered: {describe(exc)}")
            return
        delay = self.spec.retry_delay_s(max(strikes, 1))
        self.stats.retried += 1
        self.holds.hold(msg.subject, seq, delay, describe(exc))
        if away and not self._away:
            log.warning("transient failure on %s while the database is away; fetching pauses "
                        "until it is back: %s", msg.subject, describe(exc))
        elif not away:
            log.warning("transient failure on %s (%d of %d), retrying in %.1fs: %s",
                        msg.subject, strikes, self.spec.max_deliver, delay, describe(exc))
        self._away = self._away or away
        await self._settle(msg, "nak", delay)

    async def _wait_until_ready(self, idle: Callable[[], Awaitable[None]] | None) -> None:
        """Fetch nothing while the dependency is away: ask again, each interval twice the last
        (up to MAX_AWAY_PROBE_S), running ``idle`` meanwhile; back to fetching once it
        answers (or on stop())."""
        t0, wait = time.monotonic(), AWAY_PROBE_S
        self.stats.paused += 1
        while not self._stopping.is_set():
            await self._pause(wait)
            if idle is not None:
                await self._idle_guarded(idle)
            if await self._is_ready():
                break
            wait = min(wait * 2, MAX_AWAY_PROBE_S)
        self._away = False
        self.stats.paused_s += time.monotonic() - t0
        log.info("%s fetches again: its dependency answers after %.1fs away", self.spec.durable,
                 time.monotonic() - t0)

    async def _held(self, msg: Msg) -> bool:
        """Nak ``msg`` without handling it while its job waits behind a failed message, or
        while the dependency is away; False when it may run (on its last try it does: a job
        whose failures never end has each message dead-lettered in ``max_deliver`` rounds)."""
        if self._away:
            await self._settle(msg, "nak", AWAY_NAK_S)
            return True
        hold = self.holds.of(msg.subject, stream_seq(msg))
        if hold is None or self._strike(msg, away=False) >= self.spec.max_deliver:
            return False
        self.stats.held += 1
        if self.stats.held == 1 or self.stats.held % 1000 == 0:
            log.info("%s on %s waits behind %s, which failed (%s); %d held so far", msg.subject,
                     self.spec.durable, hold.subject, hold.reason[:200], self.stats.held)
        await self._settle(msg, "nak", hold.delay_s(time.monotonic()))
        return True

    def _elsewhere(self, subject: str) -> bool:
        """Whether the message is another partition's (its subject's job not ours)."""
        if self._jobs is None:
            return False
        try:
            return not self._jobs(Subjects.job_of(subject))
        except ValueError:
            return False  # not a job's subject: validated and dead-lettered as usual

    async def handle(self, msg: Msg) -> None:
        if self._elsewhere(msg.subject):
            self.stats.elsewhere += 1
            await self._settle(msg, "ack")
            return
        if await self._held(msg):
            return
        try:
            decoded = self._adapter.validate_json(msg.data)
        except ValidationError as exc:
            errs = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
            kind = "invalid_json" if any(e["type"] == "json_invalid" for e in exc.errors()) \
                else "schema"
            await self._dead_letter(msg, f"{kind}: {errs}")
            return
        forged = subject_mismatch(msg.subject, decoded)
        if forged is not None:
            await self._dead_letter(msg, f"subject_mismatch: {forged}")
            return
        try:
            await self._handler(msg.subject, decoded)
        except Exception as exc:
            await self._failed(msg, exc)
            return
        self.stats.handled += 1
        self.holds.release(msg.subject, stream_seq(msg))
        self._strikes.pop(stream_seq(msg) or 0, None)
        await self._settle(msg, "ack")

    # -- the loop ------------------------------------------------------------------------------

    async def _pause(self, seconds: float) -> None:
        """Sleep, but wake at once on stop()."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _bind_until_bound(self) -> Any | None:
        """Bind, retrying transient failures (the bus still starting) for ``bind_timeout_s``."""
        deadline = time.monotonic() + self._bind_timeout_s
        attempt = 0
        while not self._stopping.is_set():
            try:
                return await self.bind()
            except Exception as exc:
                attempt += 1
                if classify(exc) == "permanent" or time.monotonic() > deadline:
                    raise ConsumerLost(f"cannot bind consumer {self.spec.durable} on "
                                       f"{self.spec.stream}: {describe(exc)}") from exc
                log.warning("binding %s failed (attempt %d), retrying: %s", self.spec.durable,
                            attempt, describe(exc))
                await self._pause(min(0.25 * 2 ** attempt, MAX_PAUSE_S))
        return None

    def _refused(self, t: float, doing: str, *subjects: str, prefix: str | None = None
                 ) -> None:
        """Raise ConsumerLost when the server refused, since ``t``, a publish this consumer
        needs (one of ``subjects``, or any under ``prefix``) or its reply inbox: a refused
        fetch looks like an empty one, a refused ack like a success, for ever."""
        nc = self._nc
        if not isinstance(nc, BusClient):
            return
        refused = next((r for r in (nc.refused_since(t, x) for x in subjects) if r), None)
        if refused is None and prefix is not None:
            refused = nc.refusals.any_since(t, prefix)
        if refused is not None:
            denied = PermissionDenied(refused, nc.bus_user, f"{doing} durable consumer "
                                      f"{self.spec.durable!r} on {self.spec.stream}")
            raise ConsumerLost(str(denied)) from denied

    async def _fetch(self, sub: Any) -> list[Msg]:
        t0 = time.monotonic()
        try:
            msgs: list[Msg] = await sub.fetch(self.spec.batch, timeout=FETCH_WAIT_S)
        except TimeoutError:  # nothing to fetch (nats' own TimeoutError derives from it)
            self._refused(t0, "fetching from",
                          f"$JS.API.CONSUMER.MSG.NEXT.{self.spec.stream}.{self.spec.durable}")
            self._fetch_streak = 0
            return []
        except Exception as exc:
            if self._stopping.is_set():
                return []
            self.stats.fetch_failures += 1
            self._fetch_streak += 1
            if self._nc.is_closed:
                raise ConsumerLost(f"connection closed under consumer {self.spec.durable}") from exc
            if classify(exc) == "permanent" and self._fetch_streak >= PERMANENT_FETCH_LIMIT:
                raise ConsumerLost(f"consumer {self.spec.durable} cannot fetch: "
                                   f"{describe(exc)}") from exc
            log.warning("fetch failed on %s (%d in a row): %s", self.spec.durable,
                        self._fetch_streak, describe(exc), exc_info=self._fetch_streak == 1)
            await self._pause(min(0.25 * 2 ** self._fetch_streak, MAX_PAUSE_S))
            return []
        self._fetch_streak = 0
        return msgs

    async def _handle_guarded(self, msg: Msg) -> None:
        try:
            await self.handle(msg)
        except ConsumerLost:
            raise
        except Exception:  # e.g. an override of handle() that acks itself
            self.stats.handle_failures += 1
            log.exception("handling %s on %s failed; it is redelivered after the ack wait",
                          msg.subject, self.spec.durable)

    async def _idle_guarded(self, idle: Callable[[], Awaitable[None]]) -> None:
        try:
            await idle()
        except Exception:
            self.stats.idle_failures += 1
            self._idle_streak += 1
            if self._idle_streak == 1 or self._idle_streak % 100 == 0:
                log.exception("idle task of %s failed (%d in a row); consuming goes on",
                              self.spec.durable, self._idle_streak)
            return
        if self._idle_streak:
            log.info("idle task of %s works again after %d failures", self.spec.durable,
                     self._idle_streak)
            self._idle_streak = 0

    async def _check_alive(self) -> None:
        """A deleted consumer looks like an idle one to fetch (the server's 409 is swallowed as
        a timeout), so ask the server now and then whether the durable still exists."""
        now = time.monotonic()
        if self._stopping.is_set() or now - self._checked_at < self._liveness_s:
            return
        self._checked_at = now
        if self._nc.is_closed:
            raise ConsumerLost(f"connection closed under consumer {self.spec.durable}")
        try:
            await self._js.consumer_info(self.spec.stream, self.spec.durable)
        except NotFoundError as exc:
            raise ConsumerLost(f"consumer {self.spec.durable} on {self.spec.stream} no longer "
                               f"exists: {describe(exc)}") from exc
        except PermissionDenied as exc:
            raise ConsumerLost(str(exc)) from exc
        except Exception as exc:  # the bus reconnecting: fetch will tell if it lasts
            self.stats.fetch_failures += 1
            log.warning("liveness check of %s failed: %s", self.spec.durable, describe(exc))

    async def run(self, *, idle: Callable[[], Awaitable[None]] | None = None) -> None:
        """Fetch and handle until stop(); ``idle`` runs between fetches (periodic checks).

        Raises ConsumerLost when the consumer cannot go on; returns after stop().
        """
        sub = await self._bind_until_bound()
        if sub is None:
            return
        self._checked_at = time.monotonic()
        try:
            while not self._stopping.is_set():
                if self._away:
                    await self._wait_until_ready(idle)
                t0 = time.monotonic()
                for msg in await self._fetch(sub):
                    await self._handle_guarded(msg)
                self._refused(t0, "acknowledging messages of",
                              Subjects.dead_letter(self.spec.stream),
                              prefix=f"$JS.ACK.{self.spec.stream}.{self.spec.durable}.")
                if idle is not None:
                    await self._idle_guarded(idle)
                await self._check_alive()
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def stop(self) -> None:
        self._stopping.set()
