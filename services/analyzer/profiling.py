"""The profiling window: per-job buffers of the collectives agents publish in profile mode.

Agents send a row per completed call only while a job is profiled, but the durable consumer
sees every job's batches (and, after a restart, old ones): a batch is dropped on its subject's
job token before it is even decoded unless that job has an open window, and a window takes only
batches published after it opened.

Calls are timed on the GPU (NCCL is asynchronous: host enter/exit only say when the call was
enqueued): a row's arrival is its GPU start and its completion its GPU end. Rows the hook could
not time are excluded, and a rank with no GPU-timed row at all is used on host time
(core.gpu_timeline); the window says which in its ``timing`` summary, and its readiness rule
counts only the rows it will use.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from greyhound.core.gpu_timeline import Timeline, choose_timeline
from greyhound.core.slow_localization import ProfiledCalls, complete_instances
from greyhound.hookabi import P2P_OPS, op_name, signed64
from services.common.bus.client import Consumer
from services.common.bus.contract import CollectiveBatch, Subjects
from services.common.bus.streams import ANALYZER_COLLECTIVES, ConsumerSpec

# ncclDataType_t: Int8, Uint8, Int32, Uint32, Int64, Uint64, Float16, Float32, Float64, Bfloat16,
# Float8e4m3, Float8e5m2
DTYPE_BYTES = np.array([1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1], dtype=np.int64)
_COLUMNS = ("rank", "comm_id", "comm_rank", "nranks", "seq", "op", "count", "dtype", "enter_ns",
            "exit_ns", "gpu_start_ns", "gpu_end_ns")


@dataclass(frozen=True)
class WindowRule:
    """When a window has seen enough: every rank ``min_rows`` calls and every communicator
    ``min_instances`` complete instances; or ``max_data_s`` of data (by the rows' own clocks,
    virtual time for the simulator) with at least one complete instance per communicator, so
    slow iterations still end the window; or ``max_wall_s`` of waiting, whatever came.

    Both count only the communicators seen so far, and a communicator used once an iteration
    (a DP gradient all-reduce) shows its first complete instance only at the end of the first
    profiled iteration: later still when it is the slow one (a congested link). So neither
    ends a window before ``min_iterations`` of the detection's slow iteration time, from the
    first profiled call: a shorter window of a job whose iteration outgrew ``max_data_s``
    missed exactly the communicator that was slow (it found nothing)."""

    min_rows: int = 32
    min_instances: int = 3
    max_data_s: float = 2.0
    max_wall_s: float = 15.0
    min_iterations: float = 1.25


@dataclass
class ProfileBuffer:
    job_id: str
    expected_ranks: frozenset[int]
    opened_ts: float = field(default_factory=time.time)
    columns: dict[str, list[int]] = field(default_factory=lambda: {c: [] for c in _COLUMNS})
    batches: int = 0

    def add(self, batch: CollectiveBatch) -> None:
        if batch.ts < self.opened_ts - 0.5:  # from an earlier window, redelivered
            return
        for name in _COLUMNS:
            self.columns[name].extend(getattr(batch, name))
        self.batches += 1

    def __len__(self) -> int:
        return len(self.columns["rank"])

    def calls(self) -> ProfiledCalls:
        return self.window()[0]

    def window(self) -> tuple[ProfiledCalls, Timeline]:
        """The calls the localisation uses, on the timeline chosen per rank, and that choice."""
        c = {k: np.asarray(v, dtype=np.int64) for k, v in self.columns.items() if k != "comm_id"}
        timeline = choose_timeline(c["rank"], c["enter_ns"], c["exit_ns"], c["gpu_start_ns"],
                                   c["gpu_end_ns"])
        keep = timeline.keep
        c = {k: v[keep] for k, v in c.items()}
        op, dtype = c["op"], c["dtype"]
        known = (dtype >= 0) & (dtype < len(DTYPE_BYTES))
        size = np.where(known, DTYPE_BYTES[np.where(known, dtype, 0)], 1)
        names = {int(o): op_name(int(o)) for o in np.unique(op)}
        enter, exit_ = timeline.enter_ns[keep], timeline.exit_ns[keep]
        # wall ns since the epoch lose ~256 ns as float64; relative to the window they do not
        base = int(enter.min(initial=0))
        comm_ids = np.array([signed64(x) for x in self.columns["comm_id"]], dtype=np.int64)
        calls = ProfiledCalls(
            rank=c["rank"], comm_id=comm_ids[keep], comm_rank=c["comm_rank"],
            nranks=c["nranks"], seq=c["seq"],
            op=np.array([names[int(o)] for o in op.tolist()], dtype=str), nbytes=c["count"] * size,
            p2p=np.isin(op, P2P_OPS), enter_ns=(enter - base).astype(np.float64),
            exit_ns=(exit_ - base).astype(np.float64), gap_known=timeline.gap_known[keep])
        return calls, timeline

    def ready(self, rule: WindowRule, *, iteration_s: float = 0.0) -> bool:
        """Judged on the rows the localisation will use: once a rank has GPU-timed rows, its
        untimed ones (enqueued before profiling began, captured in a graph) do not count.
        ``iteration_s``: the job's iteration time as detected (slow); the window spans at
        least ``rule.min_iterations`` of it (see WindowRule)."""
        if len(self) == 0:
            return False
        calls = self.calls()
        span = float(calls.exit_ns.max() - calls.enter_ns.min()) / 1e9 if len(calls) else 0.0
        if span < rule.min_iterations * iteration_s:
            return False
        counts = np.bincount(calls.rank.clip(0))
        seen = set(np.flatnonzero(counts).tolist())
        rows_ok = self.expected_ranks <= seen and all(
            counts[r] >= rule.min_rows for r in self.expected_ranks)
        instances = _complete_per_comm(calls)
        fewest = int(instances.min()) if instances.size else 0
        if rows_ok and fewest >= rule.min_instances:
            return True
        return span >= rule.max_data_s and fewest >= 1


def _complete_per_comm(calls: ProfiledCalls) -> np.ndarray:
    """Complete instances of each collective communicator seen (one entry per communicator)."""
    coll = ~calls.p2p
    if not coll.any():
        return np.zeros(0, np.int64)
    keep = complete_instances(calls) & coll
    comms = np.unique(calls.comm_id[coll])
    first_rows = (calls.comm_rank == 0) & keep
    return np.bincount(np.searchsorted(comms, calls.comm_id[first_rows]), minlength=len(comms))


class CollectiveFeed(Consumer[CollectiveBatch]):
    """The ANALYZER_COLLECTIVES consumer: only jobs with an open window are decoded."""

    def __init__(self, js: JetStreamContext, buffers: dict[str, ProfileBuffer], *,
                 spec: ConsumerSpec = ANALYZER_COLLECTIVES) -> None:
        super().__init__(js, spec, CollectiveBatch, self._feed)
        self.buffers = buffers

    async def handle(self, msg: Msg) -> None:
        try:
            job = Subjects.job_of(msg.subject)
        except ValueError:
            job = ""
        if job not in self.buffers:
            await msg.ack()
            return
        await super().handle(msg)

    async def _feed(self, subject: str, batch: CollectiveBatch) -> None:
        buf = self.buffers.get(batch.job_id)
        if buf is not None:
            buf.add(batch)
