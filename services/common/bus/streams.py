"""JetStream streams and durable consumers, every setting stated here and nowhere else."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    SubjectTransform,
)

from services.common.bus.contract import Subjects
from services.common.settings import Settings

TELEMETRY = "GH_TELEMETRY"
EVENTS = "GH_EVENTS"
PLANS = "GH_PLANS"
DEAD_LETTERS = "GH_DLQ"
# Every stream stream_configs declares: the bus permissions grant declaring exactly these.
STREAMS = (TELEMETRY, EVENTS, PLANS, DEAD_LETTERS)


def stream_configs(settings: Settings) -> list[StreamConfig]:
    """Telemetry is bulky and short-lived; events and dead letters are small and kept for weeks.

    With several tracker partitions, telemetry is stored under partitioned subjects (see
    Subjects.telemetry_partitioning) so each tracker's consumer filters only its own jobs.
    Each stream has ``stream_replicas`` copies (3 on a 3-node cluster).
    """
    transform = None
    if settings.tracker_partitions > 1:
        src, dest = Subjects.telemetry_partitioning(settings.tracker_partitions)
        transform = SubjectTransform(src=src, dest=dest)
    return [
        StreamConfig(
            name=TELEMETRY,
            subjects=[Subjects.ALL_HELLO, Subjects.ALL_ITERATIONS, Subjects.ALL_COUNTERS,
                      Subjects.ALL_COLLECTIVES, Subjects.ALL_GPU_HEALTH],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            num_replicas=settings.stream_replicas,
            discard=DiscardPolicy.OLD,
            max_age=settings.telemetry_max_age_s,
            max_bytes=settings.telemetry_max_bytes,
            max_msg_size=8 * 1024 * 1024,
            duplicate_window=120.0,
            subject_transform=transform,
        ),
        StreamConfig(
            name=EVENTS,
            subjects=[Subjects.ALL_DETECTIONS, Subjects.ALL_INCIDENTS, Subjects.ALL_SUSPICIONS,
                      Subjects.ALL_PLAN_REPORTS],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            num_replicas=settings.stream_replicas,
            discard=DiscardPolicy.OLD,
            max_age=settings.events_max_age_s,
            max_bytes=1024**3,
            max_msg_size=1024 * 1024,
            duplicate_window=600.0,
        ),
        # The current plan of each job and nothing older: a job that (re)subscribes reads what
        # it must run now, however long ago it was decided.
        StreamConfig(
            name=PLANS,
            subjects=[Subjects.ALL_PLANS],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            num_replicas=settings.stream_replicas,
            discard=DiscardPolicy.OLD,
            max_msgs_per_subject=1,
            max_age=settings.events_max_age_s,
            max_bytes=256 * 1024**2,
            max_msg_size=8 * 1024 * 1024,
            duplicate_window=600.0,
        ),
        StreamConfig(
            name=DEAD_LETTERS,
            subjects=[Subjects.ALL_DEAD_LETTERS],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            num_replicas=settings.stream_replicas,
            discard=DiscardPolicy.OLD,
            max_age=settings.events_max_age_s,
            max_bytes=256 * 1024**2,
            max_msg_size=9 * 1024 * 1024,
        ),
    ]


class StreamMismatch(RuntimeError):
    """A stream on the server is configured otherwise than this process's settings say.

    A service refuses to start on it rather than rewrite the stream, which would change it
    under every other process (a tracker started with another GREYHOUND_TRACKER_PARTITIONS
    removing the partition transform silences every partitioned tracker): the settings or the
    stream are fixed, the latter with ``greyhound streams apply``, once, on purpose."""

    def __init__(self, stream: str, differences: list[str]) -> None:
        super().__init__(
            f"stream {stream} on the server differs from this process's settings: "
            f"{'; '.join(differences)}. Give every process the same settings, or bring the "
            f"stream to these with `greyhound streams apply` (docs/scaling.md)")
        self.stream = stream
        self.differences = differences


# The server fills these in when a process leaves them at nats-py's default: "no opinion".
_DEFAULTED = ("retention", "storage", "discard", "max_age", "max_bytes", "max_msg_size",
              "max_msgs_per_subject", "duplicate_window")
_SETTING = {"num_replicas": "GREYHOUND_STREAM_REPLICAS",
            "max_age": "GREYHOUND_TELEMETRY_MAX_AGE_S or GREYHOUND_EVENTS_MAX_AGE_S",
            "max_bytes": "GREYHOUND_TELEMETRY_MAX_BYTES",
            "subject_transform": "GREYHOUND_TRACKER_PARTITIONS"}


_UNSET = {f.name: f.default for f in fields(StreamConfig) if f.name in _DEFAULTED}


def _transform(cfg: StreamConfig) -> tuple[str, str] | None:
    t = cfg.subject_transform
    return None if t is None else (t.src, t.dest)


def stream_mismatches(want: StreamConfig, have: StreamConfig) -> list[str]:
    """How the stream the server ``have``s differs from ``want`` (this process's), one line
    per field, naming the setting that decides it; empty when they agree."""
    pairs: list[tuple[str, object, object]] = [
        ("subjects", sorted(want.subjects or []), sorted(have.subjects or [])),
        ("subject_transform", _transform(want), _transform(have)),
        ("num_replicas", want.num_replicas or 1, have.num_replicas or 1),
    ]
    pairs += [(f, getattr(want, f), getattr(have, f)) for f in _DEFAULTED
              if getattr(want, f) != _UNSET[f]]
    out = []
    for name, mine, theirs in pairs:
        if mine != theirs:
            why = f" (set by {_SETTING[name]})" if name in _SETTING else ""
            out.append(f"{name} is {theirs!r} there, {mine!r} here{why}")
    return out


@dataclass(frozen=True)
class ConsumerSpec:
    """A durable pull consumer: which stream, which subjects, and how redelivery behaves.

    What the server really does with it:

    * ``ack_wait_s`` is the one ack wait of every delivery: a message neither acked nor naked
      that long (its handler hung, or the process died) is delivered again. No BackOff list is
      sent, because the server would silently replace the ack wait with BackOff[0] (a 120 s ack
      wait with a (1, 5, ...) back-off is really 1 s, and a slow handler's message is redelivered
      while it is still being handled). A fetched batch is handled one message after another
      while every message's ack wait runs, so ``batch`` handler runs must fit in ``ack_wait_s``.
    * ``retry_delays_s`` are the delays of the consumer's own naks after a transient failure:
      the n-th delivery is retried after ``retry_delays_s[n-1]`` (the last value repeats).
    * ``max_deliver`` bounds the transient failures of one message while the consumer's
      dependency answers (bus.client.Consumer): then it is dead-lettered. The server's own
      bound is off (-1): a database outage of any length, during which failures do not count,
      must never make the server stop delivering a message.
    """

    stream: str
    durable: str
    filter_subjects: tuple[str, ...]
    ack_wait_s: float = 30.0
    max_deliver: int = 5
    retry_delays_s: tuple[float, ...] = (1.0, 5.0, 15.0, 30.0)
    max_ack_pending: int = 10_000
    batch: int = 256

    def __post_init__(self) -> None:
        if not self.filter_subjects:
            raise ValueError(f"consumer {self.durable!r}: no filter subjects")
        if self.ack_wait_s <= 0:
            raise ValueError(f"consumer {self.durable!r}: ack_wait_s must be > 0")
        if self.max_deliver < 1:
            raise ValueError(f"consumer {self.durable!r}: max_deliver must be >= 1")
        if not self.retry_delays_s or min(self.retry_delays_s) <= 0:
            raise ValueError(f"consumer {self.durable!r}: retry_delays_s must be positive")
        if self.batch < 1 or self.max_ack_pending < self.batch:
            raise ValueError(f"consumer {self.durable!r}: need 1 <= batch <= max_ack_pending")

    def retry_delay_s(self, delivery: int) -> float:
        """Delay before redelivering a message whose ``delivery``-th delivery (1-based) failed."""
        return self.retry_delays_s[min(max(delivery, 1), len(self.retry_delays_s)) - 1]

    def config(self) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=self.durable,
            name=self.durable,
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            max_deliver=-1,  # the consumer bounds deliveries itself (class docstring)
            backoff=None,  # none on purpose: see the class docstring
            max_ack_pending=self.max_ack_pending,
            filter_subjects=list(self.filter_subjects),
        )


TRACKER = ConsumerSpec(
    stream=TELEMETRY,
    durable="tracker",
    filter_subjects=(Subjects.ALL_HELLO, Subjects.ALL_ITERATIONS, Subjects.ALL_COUNTERS),
)


def tracker_spec(settings: Settings) -> ConsumerSpec:
    """The tracker's consumer: TRACKER itself, or one durable per partition of the jobs."""
    n, i = settings.tracker_partitions, settings.tracker_partition
    if n <= 1:
        return TRACKER
    return ConsumerSpec(
        stream=TELEMETRY, durable=partition_durable(TRACKER.durable, i, n),
        filter_subjects=tuple(Subjects.in_partition(f, i) for f in TRACKER.filter_subjects),
        batch=TRACKER.batch)


def partition_durable(durable: str, index: int, count: int) -> str:
    """The durable of partition ``index`` of ``count`` (services.common.ownership): the
    durable itself for one partition, else ``<durable>-p{index}-of-{count}``, so that what a
    deployment chooses is in the name, never a rewrite of another process's durable."""
    if count <= 1:
        return durable
    if not 0 <= index < count:
        raise ValueError(f"partition {index} is not one of {count}")
    return f"{durable}-p{index}-of-{count}"


def partitioned(spec: ConsumerSpec, index: int, count: int) -> ConsumerSpec:
    """Partition ``index`` of ``count`` of the analyzer's or the planner's events consumer:
    ``spec`` itself for one partition, else a durable of its own on the same subjects, whose
    owner acks the other partitions' jobs unread (Consumer's ``jobs``). The events are few and
    small, so every partition's durable reads the whole filter rather than the events stream
    being stored by partition as the telemetry is: the validator, the notifier, the API and
    the dead-letter tool read that stream as it is (docs/scaling.md)."""
    return replace(spec, durable=partition_durable(spec.durable, index, count))


def collectives_spec(index: int, count: int) -> ConsumerSpec:
    """The analyzer's collectives consumer for partition ``index`` of ``count``: the telemetry
    stream stores them under their job's partition (the same hash, services.common.ownership),
    so the server delivers each partition's durable its own jobs' only."""
    if count <= 1:
        return ANALYZER_COLLECTIVES
    return replace(ANALYZER_COLLECTIVES,
                   durable=partition_durable(ANALYZER_COLLECTIVES.durable, index, count),
                   filter_subjects=(Subjects.in_partition(Subjects.ALL_COLLECTIVES, index),))


ANALYZER = ConsumerSpec(
    stream=EVENTS,
    durable="analyzer",
    filter_subjects=(Subjects.ALL_DETECTIONS,),
    batch=64,
)
VALIDATOR = ConsumerSpec(
    stream=EVENTS,
    durable="validator",
    filter_subjects=(Subjects.ALL_SUSPICIONS,),
    # A validation pauses the job and runs benchmarks (up to the pause plus the benchmark
    # timeouts, about 40 s by default): one at a time, so no fetched suspicion waits its turn
    # while its ack wait runs out.
    ack_wait_s=120.0,
    batch=1,
)
ANALYZER_COLLECTIVES = ConsumerSpec(
    stream=TELEMETRY,
    durable="analyzer-collectives",
    # as stored: with tracker partitions the stream appends the job's partition to the subject
    filter_subjects=(Subjects.stored(Subjects.ALL_COLLECTIVES),),
    batch=256,
)
PLANNER = ConsumerSpec(
    stream=EVENTS,
    durable="planner",
    # Validated and resolved incidents, the tracker's slowdowns and recoveries, the jobs' reports.
    filter_subjects=(Subjects.ALL_INCIDENTS, Subjects.ALL_DETECTIONS, Subjects.ALL_PLAN_REPORTS),
    batch=64,
)
