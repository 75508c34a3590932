"""Draining the hook's rings on one node: records in, per-rank iterations and counters out.

No bus code here: the agent service publishes what this returns. One ``RankStream`` per ring file;
new ring files (new ranks, restarted processes) are discovered on every scan, and files that are
gone are drained once more and closed.

Every ring is untrusted input (it is written by the training process): a ring that fails its
checks on attach, or fails while it is drained or sampled, is reported to the agent's
``RingHealth`` and skipped, and every other ring is still served. Rows that cannot be real
(counters past 2^63, ranks outside their communicator, iterations of no or negative length)
are dropped before they become bus messages.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import socket
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from greyhound.core.period import IterationSegmenter
from greyhound.core.progress import window_rates
from greyhound.hookabi import (
    RECORD_DTYPE,
    CommState,
    FileId,
    Flag,
    GpuApi,
    Op,
    RingError,
    RingReader,
    profile_wait_s,
    ring_names,
)
from greyhound.hookabi.validation import sane_comm_rows, sane_records
from services.agent.health import RingHealth

log = logging.getLogger(__name__)

_COLLECTIVES = np.array([Op.ALLREDUCE, Op.ALLGATHER, Op.REDUCESCATTER, Op.BROADCAST, Op.REDUCE,
                         Op.ALLTOALL, Op.SEND, Op.RECV], dtype=np.uint16)
# Flags the hook sets only on calls it handled in profile mode (timed, lost or captured).
_PROFILE_FLAGS = np.uint32(Flag.PROFILED | Flag.CAPTURED)
# An iteration longer than a day, or ending outside int64 ns, comes from nonsense timestamps.
MAX_ITERATION_S = 86_400.0
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
    ended: bool = False  # the writer process exited: drain what is left, report no counters
    _marked: bool = False  # the hook records GPU completion marks (see _gpu_marked)
    _recent_s: deque[float] = field(default_factory=lambda: deque(maxlen=8))  # iteration times
    _api_pending: bool = field(default=False, init=False)  # announced before gpu_api was known
    # the profiler plugin's counters at the last sample (for CCL-D's rates over the window):
    # (comm_id, kind, channel, peer) -> (steps done, bytes, network ns), and when
    _prog_prev: dict[tuple[int, int, int, int], tuple[int, int, int]] = field(
        default_factory=dict, init=False)
    _prog_prev_ns: int = field(default=0, init=False)

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

    @property
    def file_id(self) -> FileId:
        """The identity of the file this stream reads (what control is keyed by)."""
        return self.reader.file_id

    def take_kept(self) -> np.ndarray:
        """The records kept since the last call, in ring order (empty when none)."""
        if not self.kept:
            return np.empty(0, RECORD_DTYPE)
        out = np.concatenate(self.kept) if len(self.kept) > 1 else self.kept[0]
        self.kept = []
        return out

    def gpu_api_learned(self) -> bool:
        """True once, when the hook has decided what this rank's GPU view rests on (its header's
        gpu_api) after the rank was first announced with it undecided."""
        if not self._api_pending or self.reader.refresh_header().gpu_api == GpuApi.UNKNOWN:
            return False
        self._api_pending = False
        return True

    def __post_init__(self) -> None:
        self._api_pending = self.reader.header.gpu_api == GpuApi.UNKNOWN

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
        recs = sane_records(recs[np.isin(recs["op"], _COLLECTIVES)])
        if len(recs) == 0:
            return []
        if self.keep_records:
            kept = recs[(recs["flags"] & _PROFILE_FLAGS) != 0] if self._gpu_marked() else recs
            if len(kept):
                self.kept.append(kept)
        iters = self.segmenter.feed(call_keys(recs), recs["enter_ns"].astype(np.int64),
                                    recs["return_ns"].astype(np.int64))
        off = self.wall_offset_ns()
        out = [RankIteration(self.rank, it.index, it.end_ns + off, it.duration_s) for it in iters
               if 0 < it.duration_s <= MAX_ITERATION_S and math.isfinite(it.duration_s)
               and 0 < it.end_ns + off < 1 << 63]
        if out:
            self._recent_s.extend(i.duration_s for i in out)
            # a profiled record waits for its GPU times (while the ring has room, RingReader)
            self.reader.gpu_wait_ns = int(profile_wait_s(max(self._recent_s)) * 1e9)
        return out


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
    last_peer: list[int] = field(default_factory=list)
    gpu_pending_peer: list[int] = field(default_factory=list)

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
        # A lifecycle call inside NCCL (init, split, shrink, destroy) is the newest call entered.
        life = int(c["life_op"])
        self.last_op.append(life or int(c["last_op"]))
        self.last_count.append(0 if life else int(c["last_count"]))
        self.last_dtype.append(0 if life else int(c["last_dtype"]))
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
        self.last_peer.append(-1 if life else int(c["last_peer"]))
        self.gpu_pending_peer.append(int(c["gpu_pending_peer"]) if pending_ns else -1)


@dataclass
class ProgressCols:
    """The columns of a ProgressRows message (see its docstring for what each one means)."""

    rank: list[int] = field(default_factory=list)
    comm_id: list[int] = field(default_factory=list)
    comm_rank: list[int] = field(default_factory=list)
    kind: list[int] = field(default_factory=list)
    channel: list[int] = field(default_factory=list)
    peer: list[int] = field(default_factory=list)
    posted: list[int] = field(default_factory=list)
    done: list[int] = field(default_factory=list)
    bytes: list[int] = field(default_factory=list)
    net_s: list[float] = field(default_factory=list)
    stalled_s: list[float] = field(default_factory=list)
    seq: list[int] = field(default_factory=list)
    rate: list[float] = field(default_factory=list)
    byte_rate: list[float] = field(default_factory=list)
    net_bw: list[float] = field(default_factory=list)

    def add(self, stream: RankStream, now_mono_ns: int) -> None:
        """One rank's plugin slots, with their rates since the rank's previous sample (a slot
        first seen has none yet: 0). Counters past 2^63 (a corrupt ring) are left out."""
        rows = stream.reader.progress_rows()
        big = np.uint64(_I63)
        ok = ((rows["posted"] < big) & (rows["done"] < big) & (rows["bytes"] < big)
              & (rows["net_ns"] < big) & (rows["seq"] < big) & (rows["last_ns"] < big))
        rows = {k: v[ok] for k, v in rows.items()}
        n = len(rows["kind"])
        done = rows["done"].astype(np.int64)
        nbytes = rows["bytes"].astype(np.int64)
        net = rows["net_ns"].astype(np.int64)
        keys = list(zip(rows["comm_id"].tolist(), rows["kind"].tolist(), rows["channel"].tolist(),
                        rows["peer"].tolist(), strict=True))
        before = [stream._prog_prev.get(k) for k in keys]
        seen = [b is not None for b in before]
        d0 = np.array([b[0] if b else d for b, d in zip(before, done.tolist(), strict=True)], np.int64)
        b0 = np.array([b[1] if b else x for b, x in zip(before, nbytes.tolist(), strict=True)],
                      np.int64)
        n0 = np.array([b[2] if b else x for b, x in zip(before, net.tolist(), strict=True)], np.int64)
        dt = (now_mono_ns - stream._prog_prev_ns) / 1e9 if stream._prog_prev_ns else 0.0
        rate, byte_rate, net_bw = window_rates(d0, done, b0, nbytes, n0 / 1e9, net / 1e9, dt)
        unseen = ~np.array(seen, dtype=bool) if n else np.zeros(0, bool)
        rate[unseen] = byte_rate[unseen] = net_bw[unseen] = 0.0
        stream._prog_prev = dict(zip(keys, zip(done.tolist(), nbytes.tolist(), net.tolist(),
                                               strict=True), strict=True))
        stream._prog_prev_ns = now_mono_ns
        self.rank.extend([stream.rank] * n)
        self.comm_id.extend(rows["comm_id"].tolist())
        self.comm_rank.extend(rows["comm_rank"].tolist())
        self.kind.extend(rows["kind"].tolist())
        self.channel.extend(rows["channel"].tolist())
        self.peer.extend(rows["peer"].tolist())
        self.posted.extend(rows["posted"].tolist())
        self.done.extend(done.tolist())
        self.bytes.extend(nbytes.tolist())
        self.net_s.extend(np.minimum(net / 1e9, _MAX_AGE_S).tolist())
        self.stalled_s.extend(_age_s(now_mono_ns, int(t)) for t in rows["last_ns"].tolist())
        self.seq.extend(rows["seq"].tolist())
        self.rate.extend(rate.tolist())
        self.byte_rate.extend(byte_rate.tolist())
        self.net_bw.extend(net_bw.tolist())


_I63 = (1 << 63) - 1
_MAX_AGE_S = 1e6  # the bus's bound on any age


def _age_s(now_ns: int, since_ns: int) -> float:
    """Seconds since a host timestamp; 0 for the hook's "none" (0)."""
    return min(max(0.0, (now_ns - since_ns) / 1e9), _MAX_AGE_S) if since_ns else 0.0


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
    """All rank streams of one job on this node; ``health`` is the agent's, shared by jobs."""

    def __init__(self, shm_dir: Path, job: str, *, health: RingHealth | None = None) -> None:
        self.shm_dir = shm_dir
        self.job = job
        self.health = health if health is not None else RingHealth()
        self.streams: dict[Path, RankStream] = {}
        self._linked = False  # the job directory was found to be a symlink (said once)
        self._retiring: list[RankStream] = []  # replaced or deleted: drained once more, closed

    def _open_dir(self) -> int | None:
        """The job directory, opened without following a symlink (a directory another user
        links there would hand its rings to this job); None when there is none to read."""
        try:
            return os.open(Path(self.shm_dir) / self.job,
                           os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR) and not self._linked:
                self._linked = True
                log.warning("job directory %s is a symbolic link or no directory: its rings are "
                            "not read", Path(self.shm_dir) / self.job)
            return None

    def scan(self) -> list[RankStream]:
        """Attach to ring files that appeared (or were re-created by a restarted rank) since the
        last scan, retire those whose process exited or whose file is gone; returns the new
        ones. A file that fails its checks is reported and skipped. Every name is looked up
        in the job directory's descriptor, so no symlink anywhere below the root is followed."""
        dfd = self._open_dir()
        try:
            return self._scan(dfd)
        finally:
            if dfd is not None:
                os.close(dfd)

    def _scan(self, dfd: int | None) -> list[RankStream]:
        new: list[RankStream] = []
        job_dir = Path(self.shm_dir) / self.job
        listed = [job_dir / n for n in ring_names(os.listdir(dfd))] if dfd is not None else []
        owner = os.fstat(dfd).st_uid if dfd is not None else -1
        for path in listed:
            try:
                file_id = FileId.of(os.stat(path.name, dir_fd=dfd, follow_symlinks=False))
            except OSError:
                continue
            old = self.streams.get(path)
            if old is not None and old.file_id == file_id:
                if not old.ended and old.writer_gone():
                    old.ended = True
                    log.info("rank %d of job %s exited; its ring is retired", old.rank, self.job)
                continue
            if self.health.skip(path, file_id):
                continue
            try:
                stream = self._attach(path, dfd, owner)
            except Exception as exc:  # whatever the file holds, it costs this ring only
                self.health.report(path, file_id, exc)
                continue
            if old is not None:
                self._retiring.append(old)
            self.streams[path] = stream
            self.health.healed(path)
            new.append(stream)
        present = set(listed)
        for path in [p for p in self.streams if p not in present]:
            self._retiring.append(self.streams.pop(path))
        self.health.forget(lambda p: p.parent != job_dir or p in present)
        return new

    def _attach(self, path: Path, dfd: int | None, owner: int) -> RankStream:
        """The ring, if its header's rank and job are its name's and its directory's and its
        owner is the directory's: a ring another local user made (in their own directory under
        this job's name, or a file of theirs in ours) must not speak for the job."""
        reader = RingReader(path, dir_fd=dfd)
        try:
            named = int(path.stem.split("-", 1)[1])
            if reader.header.rank != named:
                raise RingError(path, "rank", f"the header says rank {reader.header.rank}, the "
                                              f"file name rank {named}")
            if reader.header.job != self.job:
                raise RingError(path, "job", f"the header says job {reader.header.job!r}, the "
                                             f"directory {self.job!r}")
            if reader.owner != owner:
                raise RingError(path, "owner", f"owned by uid {reader.owner}, its job directory "
                                               f"by uid {owner}")
        except BaseException:
            reader.close()
            raise
        return RankStream(path, reader)

    def _fail(self, stream: RankStream, exc: Exception) -> None:
        """A stream that failed while being read: reported, closed, tried again later."""
        self.health.report(stream.path, stream.file_id, exc)
        if self.streams.get(stream.path) is stream:
            del self.streams[stream.path]
        stream.reader.close()

    def drain(self) -> list[RankIteration]:
        out: list[RankIteration] = []
        for stream in [*self._retiring, *self.streams.values()]:
            try:
                out.extend(stream.drain())
            except Exception as exc:
                self._fail(stream, exc)
        for stream in self._retiring:
            stream.reader.close()
        self._retiring.clear()
        return out

    def take_profiled(self) -> CollectiveRows:
        """Collective records of the ranks in profile mode, drained since the last call."""
        rows = CollectiveRows()
        for stream in list(self.streams.values()):
            if stream.kept:
                rows.add(stream.rank, stream.take_kept(), stream.wall_offset_ns())
        return rows

    def counters(self, now_mono_ns: int) -> CounterRows:
        rows = CounterRows()
        for stream in list(self.streams.values()):
            if stream.ended:
                continue
            try:
                comms = sane_comm_rows(stream.reader.comms())
            except Exception as exc:
                self._fail(stream, exc)
                continue
            for c in comms:
                rows.add(stream.rank, c, now_mono_ns)
        return rows

    def progress(self, now_mono_ns: int) -> ProgressCols:
        """The profiler plugin's counters of every live rank (nothing where it is not loaded)."""
        cols = ProgressCols()
        for stream in list(self.streams.values()):
            if stream.ended:
                continue
            try:
                cols.add(stream, now_mono_ns)
            except Exception as exc:
                self._fail(stream, exc)
        return cols

    def close(self) -> None:
        for stream in [*self._retiring, *self.streams.values()]:
            stream.reader.close()
        self.streams.clear()
        self._retiring.clear()
