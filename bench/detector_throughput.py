#!/usr/bin/env python3
"""Detector updates per second in one process: the tracker's batched path against references.

Ours: BOCD+V `update_many` over all ranks of one job per iteration (R streams, one numpy step).
References: the same detector driven one stream at a time (`make_detector().update`, what a
naive per-rank tracker would do), and the SlidingWindow baseline, batched. Input: rank-level
iteration times from the labelled trace generator (spikes, checkpoints, fail-slows included), so
the validation path runs as often as it would on a real job. Last line: RESULT {json}.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from greyhound.core.detector import OnlineDetector, make_batch_detector, make_detector
from greyhound.traces.generator import GeneratorConfig, generate_traces
from services.common.bus.client import Consumer
from services.common.bus.contract import IterationBatch, Subjects
from services.common.bus.streams import TRACKER
from services.common.embedded import EmbeddedNats
from services.common.runtime import Backends, start_service
from services.common.settings import Settings
from services.tracker.service import Telemetry, Tracker
from services.tracker.settings import TrackerSettings


def _grid(ranks: int, steps: int, seed: int = 0) -> np.ndarray:
    cfg = GeneratorConfig(min_len=steps, max_len=steps)
    traces = generate_traces(min(ranks, 64), seed, cfg)
    base = np.stack([t.times[:steps] for t in traces], axis=1)
    reps = -(-ranks // base.shape[1])
    return np.tile(base, (1, reps))[:, :ranks]


def batched(method: str, grid: np.ndarray) -> float:
    det = make_batch_detector(method, grid.shape[1])
    t0 = time.perf_counter()
    for row in grid:
        det.update_many(row)
    return grid.size / (time.perf_counter() - t0)


def per_stream(grid: np.ndarray) -> float:
    dets = [make_detector("bocd-v") for _ in range(grid.shape[1])]
    t0 = time.perf_counter()
    for row in grid.tolist():
        for d, x in zip(dets, row, strict=True):
            d.update(x)
    return grid.size / (time.perf_counter() - t0)


@dataclass(frozen=True)
class BusShape:
    """What the tracker is fed: jobs x ranks, each message one agent's flush."""

    jobs: int = 16
    ranks: int = 256
    iterations: int = 48
    ranks_per_agent: int = 8
    iterations_per_msg: int = 8

    @property
    def events(self) -> int:
        return self.jobs * self.ranks * self.iterations


def _messages(shape: BusShape, seed: int = 0) -> list[tuple[str, bytes, str]]:
    """Serialised IterationBatch messages in the order agents would publish them."""
    rng = np.random.default_rng(seed)
    out: list[tuple[str, bytes, str]] = []
    base = 0.02 * (1.0 + 0.01 * rng.standard_normal((shape.jobs, shape.ranks, shape.iterations)))
    base[0, :, shape.iterations // 2:] *= 1.5  # one job slows down half-way
    agents = shape.ranks // shape.ranks_per_agent
    k = shape.iterations_per_msg
    for it in range(0, shape.iterations, k):
        for job in range(shape.jobs):
            for a in range(agents):
                ranks = np.arange(a * shape.ranks_per_agent, (a + 1) * shape.ranks_per_agent)
                its = np.arange(it, min(it + k, shape.iterations))
                rr, ii = np.meshgrid(ranks, its, indexing="ij")
                msg = IterationBatch(
                    job_id=f"job{job}", agent_id=f"agent{a}", rank=rr.ravel().tolist(),
                    iteration=ii.ravel().tolist(),
                    end_ns=(ii.ravel() * 20_000_000).tolist(),
                    duration_s=base[job, rr.ravel(), ii.ravel()].tolist())
                out.append((Subjects.iterations(f"job{job}", f"agent{a}"),
                            msg.model_dump_json().encode(), msg.event_id))
    return out


class _NaiveTracker:
    """The naive per-rank path: one single-stream detector per rank, one Python call per value."""

    def __init__(self) -> None:
        self.dets: dict[tuple[str, int], OnlineDetector] = {}

    async def handle(self, subject: str, msg: Any) -> None:
        for r, d in zip(msg.rank, msg.duration_s, strict=True):
            det = self.dets.get((msg.job_id, r))
            if det is None:
                det = self.dets[(msg.job_id, r)] = make_detector("bocd-v")
            det.update(d)


async def _bus_run(shape: BusShape, naive: bool) -> tuple[float, int]:
    """Publish everything, then time the real tracker consumer until every message is acked."""
    with tempfile.TemporaryDirectory(prefix="gh-bench-") as d:
        server = EmbeddedNats(Path(d), auth=False)  # an open bus: the benchmark connects without users
        url = server.start()
        try:
            settings = Settings(nats_url=url, data_dir=Path(d))
            ctx = await start_service("tracker-bench", settings, need_db=False,
                                      backends=Backends(nats_url=url, database_url=""))
            msgs = _messages(shape)
            for i in range(0, len(msgs), 256):
                await asyncio.gather(*(ctx.js.publish(s, p, headers={"Nats-Msg-Id": e})
                                       for s, p, e in msgs[i:i + 256]))
            tracker = Tracker(ctx, method="bocd-v", settings=TrackerSettings())
            handler = _NaiveTracker().handle if naive else tracker.handle
            consumer: Consumer[Any] = Consumer(ctx.js, TRACKER, Telemetry, handler)
            t0 = time.perf_counter()
            task = asyncio.create_task(consumer.run(idle=tracker.tick))
            while consumer.stats.handled + consumer.stats.dead_lettered < len(msgs):
                await asyncio.sleep(0.01)
            elapsed = time.perf_counter() - t0
            consumer.stop()
            await task
            if consumer.stats.dead_lettered:
                raise RuntimeError(f"dead letters: {consumer.stats.reasons}")
            await ctx.close()
            return shape.events / elapsed, tracker.detections
        finally:
            server.stop()


def bus_events_per_s(shape: BusShape, *, naive: bool = False) -> tuple[float, int]:
    """End to end through the real NATS (JetStream) into the tracker: events/s, detections."""
    return asyncio.run(_bus_run(shape, naive))


def main() -> int:
    steps = 1500
    rows = []
    for ranks in (64, 256, 1024):
        grid = _grid(ranks, steps)
        rows.append((f"BOCD+V batched, {ranks} ranks/job", batched("bocd-v", grid)))
    ours = rows[-1][1]
    window = batched("window", _grid(1024, steps))
    rows.append(("SlidingWindow batched, 1024 ranks", window))
    naive = per_stream(_grid(8, 400))
    rows.append(("BOCD+V per stream (naive), 8 ranks", naive))
    print(f"{'path':<40} {'updates/s':>14}")
    for name, rate in rows:
        print(f"{name:<40} {rate:>14,.0f}")
    print(f"batched / per-stream speed-up at 1024 ranks: {ours / naive:.1f}x "
          f"(target >= 200,000 updates/s)")
    result: dict[str, float] = {"updates_per_s": round(ours),
                                "per_stream_updates_per_s": round(naive),
                                "window_updates_per_s": round(window)}
    for name, rate in rows[:3]:
        result[f"updates_per_s_{name.split(', ')[1].split()[0]}_ranks"] = round(rate)
    print()
    print(f"{'end to end: NATS JetStream -> tracker':<46} {'events/s':>10} {'detections':>10}")
    shapes = [("16 jobs x 256 ranks, agent = 8 ranks x 8 its", BusShape()),
              ("16 jobs x 256 ranks, agent = 8 ranks x 1 it",
               BusShape(iterations=16, iterations_per_msg=1)),
              ("16 jobs x 256 ranks, agent = 32 ranks x 8 its", BusShape(ranks_per_agent=32))]
    bus = []
    for name, shape in shapes:
        rate, found = bus_events_per_s(shape)
        bus.append(rate)
        print(f"{name:<46} {rate:>10,.0f} {found:>10}")
    naive_bus, _ = bus_events_per_s(BusShape(jobs=2, ranks=64, iterations=16), naive=True)
    print(f"{'naive per-rank detectors, 2 jobs x 64 ranks':<46} {naive_bus:>10,.0f}")
    print("target >= 50,000 events/s per tracker process (first row)")
    result["bus_events_per_s"] = round(bus[0])
    result["bus_events_per_s_1_it_per_msg"] = round(bus[1])
    result["bus_events_per_s_32_ranks_per_msg"] = round(bus[2])
    result["bus_naive_events_per_s"] = round(naive_bus)
    print("RESULT " + json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
