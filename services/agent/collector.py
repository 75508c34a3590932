"""Draining the hook's rings on one node: records in, per-rank iterations and counters out.

No bus code here: the agent service publishes what this returns. One ``RankStream`` per ring file;
new ring files (new ranks, restarted processes) are discovered on every scan.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from greyhound.core.period import IterationSegmenter
from greyhound.hookabi import RECORD_DTYPE, CommState, Flag, Op, RingReader, list_rings

log = logging.getLogger(__name__)

_COLLECTIVES = np.array([Op.ALLREDUCE, Op.ALLGATHER, Op.REDUCESCATTER, Op.BROADCAST, Op.REDUCE,
                         Op.ALLTOALL, Op.SEND, Op.RECV], dtype=np.uint16)
# Flags the hook sets only on calls it handled in profile mode (timed, lost or captured).
_PROFILE_FLAGS = np.uint32(Flag.PROFILED | Flag.CAPTURED)
_K1 = np.uint64(0x9E3779B97F4A7C15)
_K2 = np.uint64(0xC2B2AE3D27D4EB4F)


def call_keys(records: np.ndarray) -> np.ndarray:
    """A categorical key per call (op, communicator, size, peer) for period detection."""
    with np.errstate(over="ignore"):
        k = records["op"].astype(np.uint64) * _K1
        k ^= records["comm_id"].astype(np.uint64) * _K2
        k ^= records["count"].astype(np.uint64) * np.uint64(0x165667B19E3779F9)
        k ^= (records["peer"].astype(np.int64) + 1).astype(np.uint64)
    return k.view(np.int64)


@dataclass
class RankIteration:
    rank: int
    iteration: int
    end_wall_ns: int
    duration_s: float


@dataclass
class RankStream:
    """One rank's ring and the state needed to turn its records into iterations."""

    path: Path
    reader: RingReader
    segmenter: IterationSegmenter = field(default_factory=IterationSegmenter)
    # Profile mode only: drained collective records kept for the analyzer (monitor mode keeps none).
    keep_records: bool = False
    kept: list[np.ndarray] = field(default_factory=list)
    inode: int = 0
    ended: bool = False  # the writer process exited: drain what is left, report no counters
    _marked: bool = False  # the hook records GPU completion marks (see _gpu_marked)

    def writer_gone(self) -> bool:
        """True when the rank's process ran on this host and no longer exists.

        A dead job is a fail-stop, not a hang: its last call stays pending in the ring forever
        (not done on the GPU, or "inside NCCL" without GPU marks), so its counters must stop
        being reported. The check needs the agent to see the
        training processes' PIDs (same PID namespace: ``pid: host`` in containers); rings from
        other hosts (the simulator's) are never judged.
        """
        h = self.reader.header
        if h.pid <= 0 or h.host != socket.gethostname():
            return False
        return not os.path.exists(f"/proc/{h.pid}")

    @property
    def rank(self) -> int:
        return self.reader.header.rank

    def take_kept(self) -> np.ndarray:
        """The records kept since the last call, in ring order (empty when none)."""
        if not self.kept:
            return np.empty(0, RECORD_DTYPE)
        out = np.concatenate(self.kept) if len(self.kept) > 1 else self.kept[0]
        self.kept = []
        return out

    def _gpu_marked(self) -> bool:
        """True once the hook records GPU completion marks in this process (it has a CUDA
        runtime). Then a record without the profile-mode flags was enqueued before the switch to
        profile mode: it is not part of the window, and taking it as a host-only row would
        localise on host time, which says nothing on an asynchronous GPU."""
        if not self._marked:
            self._marked = bool((self.reader.comms()["gpu_marks"] != 0).any())
        return self._marked

    def wall_offset_ns(self) -> int:
        h = self.reader.header
        return int(h.wall_anchor_ns) - int(h.mono_anchor_ns)

    def drain(self, max_records: int | None = None) -> list[RankIteration]:
        recs = self.reader.poll(max_records)
        if len(recs) == 0:
            return []
        recs = recs[np.isin(recs["op"], _COLLECTIVES)]
        if len(recs) == 0:
            return []
        if self.keep_records:
            kept = recs[(recs["flags"] & _PROFILE_FLAGS) != 0] if self._gpu_marked() else recs
            if len(kept):
                self.kept.append(kept)
        iters = self.segmenter.feed(call_keys(recs), recs["enter_ns"].astype(np.int64),
                                    recs["return_ns"].astype(np.int64))
        off = self.wall_offset_ns()
        return [RankIteration(self.rank, it.index, it.end_ns + off, it.duration_s) for it in iters]


@dataclass
class CounterRows:
    """The columns of a CounterBatch (see its docstring for what each one means)."""

    rank: list[int] = field(default_factory=list)
    comm_id: list[int] = field(default_factory=list)
    comm_rank: list[int] = field(default_factory=list)
    nranks: list[int] = field(default_factory=list)
    entered: list[int] = field(default_factory=list)
    completed: list[int] = field(default_factory=list)
    last_seq_entered: list[int] = field(default_factory=list)
    last_seq_completed: list[int] = field(default_factory=list)
    inflight_s: list[float] = field(default_factory=list)
    last_op: list[int] = field(default_factory=list)
    last_count: list[int] = field(default_factory=list)
    last_dtype: list[int] = field(default_factory=list)
    gpu_marks: list[int] = field(default_factory=list)
    gpu_completed: list[int] = field(default_factory=list)
    gpu_seq_completed: list[int] = field(default_factory=list)
    gpu_pending_s: list[float] = field(default_factory=list)
    gpu_pending_seq: list[int] = field(default_factory=list)
    gpu_pending_op: list[int] = field(default_factory=list)
    gpu_pending_count: list[int] = field(default_factory=list)
    gpu_pending_dtype: list[int] = field(default_factory=list)

    def add(self, rank: int, c: np.void, now_mono_ns: int) -> None:
        """One communicator entry of a rank's ring. Ages are taken against the agent's
        monotonic clock, the clock the hook stamps host times with (same machine)."""
        self.rank.append(rank)
        self.comm_id.append(int(c["comm_id"]))
        self.comm_rank.append(int(c["rank"]))
        self.nranks.append(int(c["nranks"]))
        self.entered.append(int(c["calls_entered"]))
        self.completed.append(int(c["calls_completed"]))
        self.last_seq_entered.append(int(c["last_seq_entered"]))
        self.last_seq_completed.append(int(c["last_seq_completed"]))
        self.inflight_s.append(_age_s(now_mono_ns, int(c["inflight_enter_ns"])))
        self.last_op.append(int(c["last_op"]))
        self.last_count.append(int(c["last_count"]))
        self.last_dtype.append(int(c["last_dtype"]))
        marks = int(c["gpu_marks"]) != 0
        self.gpu_marks.append(int(marks))
        # Without marks the GPU fields are unused: published as zeros, never as stale values. A
        # destroyed or aborted communicator completes nothing more: what it left pending was
        # abandoned, not hung.
        live = int(c["state"]) == CommState.ACTIVE
        pending_ns = int(c["gpu_pending_ns"]) if marks and live else 0
        self.gpu_completed.append(int(c["gpu_calls_done"]) if marks else 0)
        self.gpu_seq_completed.append(int(c["gpu_seq_done"]) if marks else 0)
        self.gpu_pending_s.append(_age_s(now_mono_ns, pending_ns))
        self.gpu_pending_seq.append(int(c["gpu_pending_seq"]) if pending_ns else 0)
        self.gpu_pending_op.append(int(c["gpu_pending_op"]) if pending_ns else 0)
        self.gpu_pending_count.append(int(c["gpu_pending_count"]) if pending_ns else 0)
        self.gpu_pending_dtype.append(int(c["gpu_pending_dtype"]) if pending_ns else 0)


def _age_s(now_ns: int, since_ns: int) -> float:
    """Seconds since a host timestamp; 0 for the hook's "none" (0)."""
    return max(0.0, (now_ns - since_ns) / 1e9) if since_ns else 0.0


@dataclass
class CollectiveRows:
    """Profile-mode records as the columns of a CollectiveBatch, times on the wall clock."""

    rank: list[int] = field(default_factory=list)
    comm_id: list[int] = field(default_factory=list)
    comm_rank: list[int] = field(default_factory=list)
    nranks: list[int] = field(default_factory=list)
    seq: list[int] = field(default_factory=list)
    op: list[int] = field(default_factory=list)
    count: list[int] = field(default_factory=list)
    dtype: list[int] = field(default_factory=list)
    peer: list[int] = field(default_factory=list)
    enter_ns: list[int] = field(default_factory=list)
    exit_ns: list[int] = field(default_factory=list)
    gpu_start_ns: list[int] = field(default_factory=list)
    gpu_end_ns: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rank)

    def add(self, rank: int, recs: np.ndarray, wall_offset_ns: int) -> None:
        """Append one rank's records. GPU times count only with the hook's GPU_DONE flag; a call
        not timed on the GPU (unprofiled, captured in a graph, timing lost) has them 0, not
        shifted, which is how the analyzer knows to leave it out."""
        n = len(recs)
        self.rank.extend([rank] * n)
        self.comm_id.extend(recs["comm_id"].tolist())
        self.comm_rank.extend(recs["comm_rank"].tolist())
        self.nranks.extend(recs["nranks"].tolist())
        self.seq.extend(recs["seq"].tolist())
        self.op.extend(recs["op"].tolist())
        self.count.extend(recs["count"].tolist())
        self.dtype.extend(recs["datatype"].tolist())
        self.peer.extend(recs["peer"].tolist())
        off = np.int64(wall_offset_ns)
        self.enter_ns.extend((recs["enter_ns"].astype(np.int64) + off).tolist())
        self.exit_ns.extend((recs["return_ns"].astype(np.int64) + off).tolist())
        timed = (recs["flags"] & np.uint32(Flag.GPU_DONE)) != 0
        for src, dst in (("gpu_start_ns", self.gpu_start_ns), ("gpu_end_ns", self.gpu_end_ns)):
            t = recs[src].astype(np.int64)
            dst.extend(np.where(timed & (t > 0), t + off, 0).tolist())

    def chunks(self, size: int) -> list[CollectiveRows]:
        """Consecutive slices of at most ``size`` rows (bus messages have a size limit)."""
        out: list[CollectiveRows] = []
        for lo in range(0, len(self), size):
            part = CollectiveRows()
            for name, col in vars(self).items():
                getattr(part, name).extend(col[lo:lo + size])
            out.append(part)
        return out


class Collector:
    """All rank streams of one job on this node."""

    def __init__(self, shm_dir: Path, job: str) -> None:
        self.shm_dir = shm_dir
        self.job = job
        self.streams: dict[Path, RankStream] = {}

    def scan(self) -> list[RankStream]:
        """Attach to ring files that appeared (or were re-created by a restarted rank) since the
        last scan, and retire those whose process exited; returns the new ones."""
        new: list[RankStream] = []
        for path in list_rings(self.shm_dir, self.job):
            try:
                inode = path.stat().st_ino
            except OSError:
                continue
            old = self.streams.get(path)
            if old is not None and old.inode == inode:
                if not old.ended and old.writer_gone():
                    old.ended = True
                    log.info("rank %d of job %s exited; its ring is retired", old.rank, self.job)
                continue
            try:
                reader = RingReader(path)
            except (OSError, ValueError) as exc:  # half-written or foreign file: retry next scan
                log.debug("cannot attach %s yet: %s", path, exc)
                continue
            if old is not None:
                old.reader.close()
            stream = RankStream(path, reader, inode=inode)
            self.streams[path] = stream
            new.append(stream)
        return new

    def drain(self) -> list[RankIteration]:
        out: list[RankIteration] = []
        for stream in self.streams.values():
            out.extend(stream.drain())
        return out

    def take_profiled(self) -> CollectiveRows:
        """Collective records of the ranks in profile mode, drained since the last call."""
        rows = CollectiveRows()
        for stream in self.streams.values():
            if stream.kept:
                rows.add(stream.rank, stream.take_kept(), stream.wall_offset_ns())
        return rows

    def counters(self, now_mono_ns: int) -> CounterRows:
        rows = CounterRows()
        for stream in self.streams.values():
            if stream.ended:
                continue
            for c in stream.reader.comms():
                rows.add(stream.rank, c, now_mono_ns)
        return rows

    def close(self) -> None:
        for stream in self.streams.values():
            stream.reader.close()
        self.streams.clear()
