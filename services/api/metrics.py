"""``/metrics``: Prometheus text for what on-call watches.

The API process observes little itself (its own requests), so most series are computed at
scrape time from where the truth lives:

* Postgres: incidents by kind and state; detection latency (onset to detection, estimated as in
  greyhound.core.incident_cost), localisation latency (opening to first localisation) and
  validation pauses (the validator's measured ``pause_s``) as histograms over the incidents of
  the last ``WINDOW`` (a sliding window: read them with ``histogram_quantile`` on the current
  value, not with ``rate``); GPU-hours lost, and saved by plans, by kind over the same window;
  webhook attempts by outcome and deliveries by state (counts of the attempt log, so they only
  grow).
* JetStream: messages ingested per stream (the stream's last sequence, a counter that survives
  restarts of every service), messages dead-lettered per source stream (the dead-letter
  stream's per-subject counts) and each durable consumer's backlog.

A series whose source is unreachable is left out, and ``greyhound_metrics_source_up`` says so.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from sqlalchemy.ext.asyncio import AsyncSession

from greyhound.core.incident_cost import localization_latency_s
from services.common.bus.contract import DLQ_PREFIX
from services.common.bus.streams import DEAD_LETTERS, EVENTS, TELEMETRY
from services.common.db import repository as repo
from services.common.incident_cost import cost_of, timeline_of, validation_pause_s

log = logging.getLogger(__name__)

WINDOW = timedelta(days=30)
LATENCY_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
PAUSE_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0)

# The API's own traffic: a process-local registry, so tests can build apps side by side.
API_REGISTRY = CollectorRegistry(auto_describe=True)
REQUESTS = Counter("greyhound_api_requests", "REST requests served", ["method", "route", "status"],
                   registry=API_REGISTRY)
REQUEST_SECONDS = Histogram("greyhound_api_request_seconds", "REST request latency",
                            ["route"], registry=API_REGISTRY)


@dataclass
class Snapshot:
    incidents: list[tuple[str, str, int]] = field(default_factory=list)
    detection_latency: list[float] = field(default_factory=list)
    localization_latency: list[float] = field(default_factory=list)
    pauses: list[float] = field(default_factory=list)
    gpu_hours: dict[str, float] = field(default_factory=dict)
    gpu_hours_saved: dict[str, float] = field(default_factory=dict)
    attempts: list[tuple[str, int]] = field(default_factory=list)
    deliveries: list[tuple[str, int]] = field(default_factory=list)
    stream_messages: dict[str, int] = field(default_factory=dict)
    dead_letters: dict[str, int] = field(default_factory=dict)
    consumer_pending: dict[tuple[str, str], int] = field(default_factory=dict)
    sources: dict[str, bool] = field(default_factory=dict)


async def from_database(session: AsyncSession, snap: Snapshot, now: datetime) -> None:
    snap.incidents = await repo.incident_counts(session)
    snap.attempts = await repo.attempt_outcomes(session)
    snap.deliveries = await repo.delivery_states(session)
    incidents = await repo.incidents_since(session, now - WINDOW)
    jobs = await repo.jobs_by_id(session, sorted({i.job_id for i in incidents}))
    ranks = await repo.rank_counts(session, sorted({i.job_id for i in incidents}))
    for inc in incidents:
        timeline = timeline_of(inc)
        job = jobs.get(inc.job_id)
        gpus = (job.world_size if job is not None and job.world_size else None) \
            or ranks.get(inc.job_id)
        cost = cost_of(inc, gpus=gpus, now=now)
        if cost.detection_latency_s is not None:
            snap.detection_latency.append(cost.detection_latency_s)
        loc = localization_latency_s(timeline, inc.opened_at)
        if loc is not None:
            snap.localization_latency.append(loc)
        pause = validation_pause_s(inc)
        if pause is not None:
            snap.pauses.append(pause)
        if cost.gpu_hours_lost is not None:
            snap.gpu_hours[inc.kind] = snap.gpu_hours.get(inc.kind, 0.0) + cost.gpu_hours_lost
        if cost.gpu_hours_saved is not None:
            snap.gpu_hours_saved[inc.kind] = (snap.gpu_hours_saved.get(inc.kind, 0.0)
                                              + cost.gpu_hours_saved)


async def from_jetstream(js: JetStreamContext, snap: Snapshot) -> None:
    for stream in (TELEMETRY, EVENTS, DEAD_LETTERS):
        info = await js.stream_info(stream)
        snap.stream_messages[stream] = int(info.state.last_seq or 0)
    dlq = await js.stream_info(DEAD_LETTERS, subjects_filter=f"{DLQ_PREFIX}.>")
    for subject, n in (dlq.state.subjects or {}).items():
        snap.dead_letters[subject.removeprefix(f"{DLQ_PREFIX}.")] = int(n)
    for stream in (TELEMETRY, EVENTS):
        for c in await js.consumers_info(stream):
            if c.config.durable_name:
                snap.consumer_pending[(stream, c.config.durable_name)] = int(c.num_pending or 0)


def _histogram(name: str, doc: str, values: Sequence[float],
               buckets: Sequence[float]) -> HistogramMetricFamily:
    cumulative = [(str(b), float(sum(v <= b for v in values))) for b in buckets]
    cumulative.append(("+Inf", float(len(values))))
    return HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=float(sum(values)))


class SnapshotCollector(Collector):
    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap

    def collect(self) -> Iterable[Metric]:
        s = self.snap
        up = GaugeMetricFamily("greyhound_metrics_source_up",
                               "1 when the source of a group of series answered this scrape",
                               labels=["source"])
        for source, ok in sorted(s.sources.items()):
            up.add_metric([source], 1.0 if ok else 0.0)
        yield up
        if s.sources.get("database"):
            inc = GaugeMetricFamily("greyhound_incidents", "incidents by kind and state",
                                    labels=["kind", "state"])
            for kind, state, n in s.incidents:
                inc.add_metric([kind, state], n)
            yield inc
            yield _histogram("greyhound_detection_latency_seconds",
                             "onset of a fail-slow or hang to its detection (incidents of the "
                             "last 30 days)", s.detection_latency, LATENCY_BUCKETS)
            yield _histogram("greyhound_localization_latency_seconds",
                             "incident opened to first localisation (last 30 days)",
                             s.localization_latency, LATENCY_BUCKETS)
            yield _histogram("greyhound_validation_pause_seconds",
                             "how long validations held jobs paused; _count is the number of "
                             "pauses (last 30 days)", s.pauses, PAUSE_BUCKETS)
            cost = GaugeMetricFamily("greyhound_gpu_hours_lost",
                                     "GPU-hours lost to incidents opened in the last 30 days",
                                     labels=["kind"])
            for kind, hours in sorted(s.gpu_hours.items()):
                cost.add_metric([kind], hours)
            yield cost
            saved = GaugeMetricFamily("greyhound_gpu_hours_saved",
                                      "GPU-hours mitigation plans saved on incidents opened in "
                                      "the last 30 days (against the level each plan found)",
                                      labels=["kind"])
            for kind, hours in sorted(s.gpu_hours_saved.items()):
                saved.add_metric([kind], hours)
            yield saved
            att = CounterMetricFamily("greyhound_webhook_attempts",
                                      "webhook delivery attempts by outcome", labels=["outcome"])
            for outcome, n in s.attempts:
                att.add_metric([outcome], n)
            yield att
            dl = GaugeMetricFamily("greyhound_webhook_deliveries", "webhook deliveries by state",
                                   labels=["state"])
            for state, n in s.deliveries:
                dl.add_metric([state], n)
            yield dl
        if s.sources.get("nats"):
            msgs = CounterMetricFamily("greyhound_bus_messages",
                                       "messages ingested by each JetStream stream",
                                       labels=["stream"])
            for stream, n in sorted(s.stream_messages.items()):
                msgs.add_metric([stream], n)
            yield msgs
            dead = GaugeMetricFamily("greyhound_dead_letters",
                                     "dead-lettered messages retained, by source stream",
                                     labels=["stream"])
            for stream, n in sorted(s.dead_letters.items()):
                dead.add_metric([stream], n)
            yield dead
            pend = GaugeMetricFamily("greyhound_consumer_pending",
                                     "messages not yet delivered to each durable consumer",
                                     labels=["stream", "consumer"])
            for (stream, name), n in sorted(s.consumer_pending.items()):
                pend.add_metric([stream, name], n)
            yield pend


async def render(session: AsyncSession, js: JetStreamContext | None) -> bytes:
    snap = Snapshot()
    now = datetime.now(UTC)
    try:
        await from_database(session, snap, now)
        snap.sources["database"] = True
    except Exception:
        log.exception("metrics: database read failed")
        snap.sources["database"] = False
    if js is not None:
        try:
            await from_jetstream(js, snap)
            snap.sources["nats"] = True
        except Exception:
            log.exception("metrics: JetStream read failed")
            snap.sources["nats"] = False
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snap))
    return generate_latest(registry) + generate_latest(API_REGISTRY)
