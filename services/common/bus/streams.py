"""JetStream streams and durable consumers, every setting stated here and nowhere else."""

from __future__ import annotations

from dataclasses import dataclass

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
DEAD_LETTERS = "GH_DLQ"


def stream_configs(settings: Settings) -> list[StreamConfig]:
    """Telemetry is bulky and short-lived; events and dead letters are small and kept for weeks.

    With several tracker partitions, telemetry is stored under partitioned subjects (see
    Subjects.telemetry_partitioning) so each tracker's consumer filters only its own jobs.
    """
    transform = None
    if settings.tracker_partitions > 1:
        src, dest = Subjects.telemetry_partitioning(settings.tracker_partitions)
        transform = SubjectTransform(src=src, dest=dest)
    return [
        StreamConfig(
            name=TELEMETRY,
            subjects=[Subjects.ALL_HELLO, Subjects.ALL_ITERATIONS, Subjects.ALL_COUNTERS,
                      Subjects.ALL_COLLECTIVES],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            max_age=settings.telemetry_max_age_s,
            max_bytes=settings.telemetry_max_bytes,
            max_msg_size=8 * 1024 * 1024,
            duplicate_window=120.0,
            subject_transform=transform,
        ),
        StreamConfig(
            name=EVENTS,
            subjects=[Subjects.ALL_DETECTIONS, Subjects.ALL_INCIDENTS, Subjects.ALL_SUSPICIONS],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            max_age=settings.events_max_age_s,
            max_bytes=1024**3,
            max_msg_size=1024 * 1024,
            duplicate_window=600.0,
        ),
        StreamConfig(
            name=DEAD_LETTERS,
            subjects=[Subjects.ALL_DEAD_LETTERS],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            max_age=settings.events_max_age_s,
            max_bytes=256 * 1024**2,
            max_msg_size=9 * 1024 * 1024,
        ),
    ]


@dataclass(frozen=True)
class ConsumerSpec:
    """A durable pull consumer: which stream, which subjects, and how redelivery behaves."""

    stream: str
    durable: str
    filter_subjects: tuple[str, ...]
    ack_wait_s: float = 30.0
    max_deliver: int = 5
    backoff_s: tuple[float, ...] = (1.0, 5.0, 15.0, 30.0)
    max_ack_pending: int = 10_000
    batch: int = 256

    def config(self) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=self.durable,
            name=self.durable,
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            max_deliver=self.max_deliver,
            backoff=list(self.backoff_s),
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
        stream=TELEMETRY, durable=f"tracker-p{i}-of-{n}",
        filter_subjects=tuple(Subjects.in_partition(f, i) for f in TRACKER.filter_subjects),
        batch=TRACKER.batch)


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
    ack_wait_s=120.0,  # a validation pauses the job and runs benchmarks: allow for it
    batch=8,
)
ANALYZER_COLLECTIVES = ConsumerSpec(
    stream=TELEMETRY,
    durable="analyzer-collectives",
    filter_subjects=(Subjects.ALL_COLLECTIVES,),
    batch=256,
)
ALERTS = ConsumerSpec(
    stream=EVENTS,
    durable="alerts",
    filter_subjects=(Subjects.ALL_INCIDENTS,),
    batch=64,
)
