#!/usr/bin/env python3
"""Tracker scale-out: 1, 2 and 4 partitions through a real NATS JetStream, and a takeover.

Each configuration starts its own embedded nats-server (the telemetry stream partitioned N ways)
and N ``greyhound tracker`` processes (as deployed: their own bus user, the shared embedded
Postgres, each holding one partition's lease), then publishes the same iteration telemetry (an
event is one agent's batch: ``--ranks`` ranks x ``--iterations`` iterations) for ``--jobs`` jobs
from this process, and times it until every partition's durable has delivered and had acked
every event. Reported: events per second in all (publisher, trackers, nats-server and Postgres
sharing this machine's cores) and the trackers' CPU seconds (user + system, /proc) per million
events, counted from when every partition was owned and idle to when all was consumed: on a
machine with few cores the cost per event is the figure that says whether partitioning adds
coordination cost (target: within 15% of one partition's at 2 and 4).

The takeover: 2 partitions, 3 processes (one standing by). Telemetry flows at ``--rate`` events
per second; the owner of partition 0 is killed with SIGKILL; ``takeover_s`` is the time from the
kill until partition 0's durable delivers again (to the standby, which took its lease), and
``lease_s`` until the standby holds the lease (target <= 10 s). Publishing stops a few seconds
later, and everything is drained (the killed owner's unacknowledged events come back after the
consumer's ack wait, 30 s).

Lost and duplicated: every tracker is stopped (SIGTERM: it saves its jobs), and each job's
saved state says how many batches it observed; ``lost`` sums the published batches no state
counts, ``duplicated`` those counted twice, over every configuration and the takeover.

Last line: RESULT {json} with events_per_s_by_partitions, cpu_s_per_million_by_partitions,
takeover_s, lost, duplicated (and lease_s, cost_ratio_by_partitions, events).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from nats.js import JetStreamContext

from services.common.bus.auth import agent_user
from services.common.bus.client import connect, ensure_streams
from services.common.bus.contract import IterationBatch, Subjects
from services.common.bus.streams import TELEMETRY, tracker_spec
from services.common.db.migrate import upgrade_async
from services.common.embedded import OPERATOR, EmbeddedNats, EmbeddedPostgres
from services.common.leases import owner_pid, owners
from services.common.settings import Settings
from services.tracker.ownership import LEASE_SERVICE
from services.tracker.state_store import TrackerStateStore
from stack.up import end_processes

ROOT = Path(__file__).resolve().parents[1]
AGENT = "a0"
COST_TARGET = 0.15
TAKEOVER_TARGET_S = 10.0
ACK_WAIT_S = 30.0  # the tracker consumer's (services.common.bus.streams.TRACKER)


@dataclass
class Workload:
    jobs: int
    ranks: int
    iterations: int  # per event
    events: int  # in all, spread evenly over the jobs
    seed: int = 1
    sent: dict[str, int] = field(default_factory=dict)  # job -> batches published

    def job(self, k: int) -> str:
        return f"bench-{k:04d}"

    def messages(self, start: int, count: int) -> Iterator[tuple[str, bytes, str]]:
        """``count`` events from the ``start``-th on: (subject, body, event id), jobs in turn."""
        rng = np.random.default_rng(self.seed + start)
        ranks = list(range(self.ranks))
        for n in range(start, start + count):
            k, step = n % self.jobs, n // self.jobs
            first = step * self.iterations
            its = list(range(first, first + self.iterations))
            x = 0.1 * (1.0 + 0.01 * rng.standard_normal(self.ranks * self.iterations))
            job = self.job(k)
            msg = IterationBatch(job_id=job, agent_id=AGENT,
                                 rank=[r for r in ranks for _ in its],
                                 iteration=[i for _ in ranks for i in its],
                                 end_ns=[(i + 1) * 100_000_000 for _ in ranks for i in its],
                                 duration_s=[float(v) for v in x])
            self.sent[job] = self.sent.get(job, 0) + 1
            yield Subjects.iterations(job, AGENT), msg.model_dump_json().encode(), msg.event_id


def process_cpu_s(pid: int) -> float:
    """A live process's CPU time so far, user and system (Linux's /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Rig:
    """One embedded nats-server (partitioned N ways) and tracker processes on the shared
    Postgres."""

    def __init__(self, root: Path, db_url: str, partitions: int, name: str) -> None:
        self.root = root
        self.name = name
        self.partitions = partitions
        self.db_url = db_url
        self.nats = EmbeddedNats(root / f"nats-{name}", tracker_partitions=partitions)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.cpu0: dict[int, float] = {}

    def __enter__(self) -> Rig:
        self.nats.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_trackers()
        self.nats.stop()

    def durable(self, p: int) -> str:
        return tracker_spec(Settings.model_construct(
            tracker_partitions=self.partitions, tracker_partition=p)).durable

    def start_tracker(self) -> subprocess.Popen[bytes]:
        creds = self.nats.credentials("tracker")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "GREYHOUND_NATS_URL": self.nats.url,
               "GREYHOUND_NATS_USER": creds.user, "GREYHOUND_NATS_PASSWORD": creds.password,
               "GREYHOUND_DATABASE_URL": self.db_url,
               "GREYHOUND_DATA_DIR": str(self.root / "svc"),
               "GREYHOUND_TRACKER_PARTITIONS": str(self.partitions),
               "GREYHOUND_LOG_LEVEL": "WARNING"}
        env.pop("GREYHOUND_TRACKER_PARTITION", None)
        log = (self.root / f"tracker-{self.name}-{len(self.procs)}.log").open("ab")
        proc = subprocess.Popen([sys.executable, "-m", "stack.cli", "tracker"], cwd=ROOT,
                                env=env, stdout=log, stderr=log, start_new_session=True)
        log.close()
        self.procs.append(proc)
        return proc

    def stop_trackers(self) -> None:
        end_processes(self.procs, 30.0)

    def cpu_s(self) -> float:
        """CPU seconds the trackers with a baseline used since it."""
        return sum(process_cpu_s(p.pid) - self.cpu0[p.pid] for p in self.procs
                   if p.poll() is None and p.pid in self.cpu0)

    def mark_cpu(self) -> None:
        self.cpu0 = {p.pid: process_cpu_s(p.pid) for p in self.procs if p.poll() is None}

    async def owners(self) -> dict[int, int]:
        """Partition -> pid of the tracker holding its lease."""
        return {p: owner_pid(name) or 0
                for p, name in (await owners(self.db_url, LEASE_SERVICE)).items()}

    async def mark_cpu_at_lease(self, timeout_s: float = 90.0) -> float:
        """Each tracker's CPU baseline taken the moment it holds a lease (polled every 10 ms);
        when the first one did."""
        end = time.monotonic() + timeout_s
        self.cpu0, first = {}, None
        while len(self.cpu0) < self.partitions:
            for pid in (await self.owners()).values():
                if pid not in self.cpu0:
                    self.cpu0[pid] = process_cpu_s(pid)
                    first = first or time.monotonic()
            if time.monotonic() > end:
                raise RuntimeError(f"trackers not ready; logs in {self.root}")
            await asyncio.sleep(0.01)
        assert first is not None
        return first

    async def operator(self) -> JetStreamContext:
        nc = await connect(self.nats.url, name="bench-operator",
                           credentials=self.nats.credentials(OPERATOR))
        return nc.jetstream()

    async def until_ready(self, js: JetStreamContext, timeout_s: float = 90.0) -> dict[int, int]:
        """Every partition owned and its durable bound; the owners."""
        end = time.monotonic() + timeout_s
        while True:
            owners = await self.owners()
            if len(owners) == self.partitions:
                try:
                    for p in range(self.partitions):
                        await js.consumer_info(TELEMETRY, self.durable(p))
                    return owners
                except Exception:
                    pass
            if time.monotonic() > end:
                raise RuntimeError(f"trackers not ready: owners {owners}; logs in {self.root}")
            await asyncio.sleep(0.1)

    async def until_drained(self, js: JetStreamContext, timeout_s: float) -> float:
        """Wait until every durable delivered and had acked everything; when that was."""
        end = time.monotonic() + timeout_s
        while True:
            left = 0
            for p in range(self.partitions):
                info = await js.consumer_info(TELEMETRY, self.durable(p))
                left += int(info.num_pending or 0) + int(info.num_ack_pending or 0)
            if not left:
                return time.monotonic()
            if time.monotonic() > end:
                raise RuntimeError(f"{left} events not consumed within {timeout_s:.0f}s")
            await asyncio.sleep(0.05)

    async def observed(self, js: JetStreamContext, jobs: list[str]) -> dict[str, int]:
        """Each job's batches observed, from the state its tracker saved."""
        store = await TrackerStateStore(js).open()
        out = {}
        for job in jobs:
            state = await store.load(job)
            out[job] = int(state.get("batches", 0)) if state else 0
        return out


async def publish_all(js: JetStreamContext, msgs: Iterator[tuple[str, bytes, str]],
                      rate: float | None = None, stop: asyncio.Event | None = None,
                      window: int = 256) -> int:
    """Publish with up to ``window`` acknowledgements outstanding; at ``rate`` per second if
    given; until ``stop`` if given."""
    sent, t0 = 0, time.monotonic()
    pending: list[asyncio.Future[object]] = []
    while stop is None or not stop.is_set():
        item = next(msgs, None)  # taken (and counted as sent) only when it will be published
        if item is None:
            break
        subject, body, event_id = item
        pending.append(asyncio.ensure_future(
            js.publish(subject, body, headers={"Nats-Msg-Id": event_id})))
        sent += 1
        if len(pending) >= window:
            await asyncio.gather(*pending)
            pending.clear()
        if rate is not None:
            ahead = sent / rate - (time.monotonic() - t0)
            if ahead > 0:
                await asyncio.sleep(ahead)
    await asyncio.gather(*pending)
    return sent


def tally(sent: dict[str, int], seen: dict[str, int]) -> tuple[int, int]:
    lost = sum(max(0, n - seen.get(j, 0)) for j, n in sent.items())
    dup = sum(max(0, seen.get(j, 0) - n) for j, n in sent.items())
    return lost, dup


async def throughput(root: Path, db_url: str, partitions: int, w: Workload, *, backlog: bool
                     ) -> tuple[float, float, int, int]:
    """(events/s, tracker CPU s per million events, lost, duplicated) with N partitions.

    ``backlog``: every event is in the stream before the trackers start; each tracker's CPU is
    counted from when it took its partition's lease (its start-up before that left out), the
    time from the first lease to the last event acknowledged. Otherwise (live): the trackers
    own their partitions and idle, then the events are published as fast as this process can,
    CPU and time counted from the first publish."""
    with Rig(root, db_url, partitions, f"{partitions}p-{'backlog' if backlog else 'live'}"
             ) as rig:
        js = await rig.operator()
        agent = await connect(rig.nats.url, name="bench-agent",
                              credentials=rig.nats.credentials(agent_user(AGENT)))
        try:
            msgs = list(w.messages(0, w.events))  # made before any clock starts
            if backlog:
                await ensure_streams(js, Settings(tracker_partitions=partitions))
                await publish_all(agent.jetstream(), iter(msgs))
                for _ in range(partitions):
                    rig.start_tracker()
                t0 = await rig.mark_cpu_at_lease()
            else:
                for _ in range(partitions):
                    rig.start_tracker()
                await rig.until_ready(js)
                await asyncio.sleep(1.0)  # their start-up settled
                rig.mark_cpu()
                t0 = time.monotonic()
                await publish_all(agent.jetstream(), iter(msgs))
            t1 = await rig.until_drained(js, timeout_s=600)
            cpu = rig.cpu_s()
            rig.stop_trackers()
            lost, dup = tally(w.sent, await rig.observed(js, list(w.sent)))
        finally:
            await agent.close()
            await js._nc.close()
    return w.events / (t1 - t0), cpu / w.events * 1e6, lost, dup


async def takeover(root: Path, db_url: str, w: Workload, rate: float
                   ) -> tuple[float, float, int, int]:
    """(takeover s, lease s, lost, duplicated): 2 partitions, 3 trackers, partition 0's owner
    killed while telemetry flows."""
    with Rig(root, db_url, 2, "takeover") as rig:
        js = await rig.operator()
        agent = await connect(rig.nats.url, name="bench-agent",
                              credentials=rig.nats.credentials(agent_user(AGENT)))
        stop = asyncio.Event()
        try:
            for _ in range(3):
                rig.start_tracker()
            owners = await rig.until_ready(js)
            flow = asyncio.create_task(publish_all(agent.jetstream(), w.messages(0, 10**9),
                                                   rate=rate, stop=stop, window=16))
            await asyncio.sleep(4.0)
            victim = owners[0]
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            while (await rig.owners()).get(0, victim) == victim:
                if time.monotonic() - killed > 60:
                    raise RuntimeError("partition 0 was not taken over within 60 s")
                await asyncio.sleep(0.02)
            leased = time.monotonic()
            seq = (await js.consumer_info(TELEMETRY, rig.durable(0))).delivered.stream_seq
            while (await js.consumer_info(TELEMETRY, rig.durable(0))).delivered.stream_seq <= seq:
                if time.monotonic() - killed > 60:
                    raise RuntimeError("partition 0 was not consumed again within 60 s")
                await asyncio.sleep(0.02)
            consumed = time.monotonic()
            await asyncio.sleep(3.0)
            stop.set()
            await flow
            await rig.until_drained(js, timeout_s=ACK_WAIT_S + 60)
            rig.stop_trackers()
            lost, dup = tally(w.sent, await rig.observed(js, list(w.sent)))
        finally:
            stop.set()
            await agent.close()
            await js._nc.close()
    return consumed - killed, leased - killed, lost, dup


async def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="gh-scaleout-"))
    pg = EmbeddedPostgres(root / "pg")
    try:
        db_url = pg.start()
        await upgrade_async(db_url)
        rates: dict[str, dict[str, float]] = {"backlog": {}, "live": {}}
        costs: dict[str, dict[str, float]] = {"backlog": {}, "live": {}}
        lost = dup = 0
        for mode in ("backlog", "live"):
            for n in args.partitions:
                w = Workload(args.jobs, args.ranks, args.iterations, args.events)
                eps, cost, lo, du = await throughput(root, db_url, n, w,
                                                     backlog=mode == "backlog")
                rates[mode][str(n)], costs[mode][str(n)] = round(eps, 1), round(cost, 1)
                lost, dup = lost + lo, dup + du
                print(f"  {mode:>7}, {n} partition(s): {eps:6.0f} events/s  {cost:7.1f} CPU s "
                      f"per million events  (lost {lo}, duplicated {du})", flush=True)
        w = Workload(args.jobs, args.ranks, args.iterations, 0, seed=2)
        took, leased, lo, du = await takeover(root, db_url, w, args.rate)
        lost, dup = lost + lo, dup + du
        print(f"  takeover after SIGKILL: lease in {leased:.2f} s, consuming again in "
              f"{took:.2f} s  (lost {lo}, duplicated {du})", flush=True)
    finally:
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)
    def ratio(c: dict[str, float]) -> dict[str, float]:
        return {k: round(v / c[str(args.partitions[0])], 3) for k, v in c.items()}

    return {"events_per_s_by_partitions": rates["backlog"],
            "cpu_s_per_million_by_partitions": costs["backlog"],
            "cost_ratio_by_partitions": ratio(costs["backlog"]),
            "live_events_per_s_by_partitions": rates["live"],
            "live_cpu_s_per_million_by_partitions": costs["live"],
            "live_cost_ratio_by_partitions": ratio(costs["live"]),
            "takeover_s": round(took, 2),
            "lease_s": round(leased, 2), "lost": lost, "duplicated": dup,
            "events": args.events, "jobs": args.jobs,
            "samples_per_event": args.ranks * args.iterations}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--partitions", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--jobs", type=int, default=64)
    ap.add_argument("--ranks", type=int, default=8, help="ranks per event (one agent's)")
    ap.add_argument("--iterations", type=int, default=4, help="iterations per event")
    ap.add_argument("--events", type=int, default=8_000, help="events per configuration")
    ap.add_argument("--rate", type=float, default=400.0, help="events/s during the takeover")
    args = ap.parse_args()
    print(f"tracker scale-out: {args.events} events per configuration, {args.jobs} jobs, "
          f"{args.ranks * args.iterations} samples per event; {os.cpu_count()} CPU(s)",
          flush=True)
    result = asyncio.run(run(args))
    print()
    print(f"{'partitions':>10} {'events/s':>9} {'CPU s/M':>8} {'x one':>6}   "
          f"{'live events/s':>13} {'CPU s/M':>8} {'x one':>6}")
    rb, cb, xb, rl, cl, xl = (result[k] for k in (
        "events_per_s_by_partitions", "cpu_s_per_million_by_partitions",
        "cost_ratio_by_partitions", "live_events_per_s_by_partitions",
        "live_cpu_s_per_million_by_partitions", "live_cost_ratio_by_partitions"))
    for k in xb:
        print(f"{k:>10} {rb[k]:>9.0f} {cb[k]:>8.1f} {xb[k]:>6.3f}   "
              f"{rl[k]:>13.0f} {cl[k]:>8.1f} {xl[k]:>6.3f}")
    worst = max((v for k, v in xb.items() if k != str(args.partitions[0])), default=1.0)
    print(f"cost per event (backlog) within {COST_TARGET:.0%} of one partition's: "
          f"{'met' if worst <= 1 + COST_TARGET else 'MISSED'} (worst x{worst:.3f})")
    took = result["takeover_s"]
    print(f"takeover {took:.2f} s (target <= {TAKEOVER_TARGET_S:.0f} s): "
          f"{'met' if took <= TAKEOVER_TARGET_S else 'MISSED'}; lost {result['lost']}, "
          f"duplicated {result['duplicated']}")
    print("RESULT " + json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
