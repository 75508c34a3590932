"""The agent's side of a ring: records out (RingReader), requests in (Control).

Both go through a :class:`RingFile` (pread/pwrite, never a mapping), so a ring that shrinks,
lies in its header or counts nonsense raises a RingError here instead of crashing the agent or
making it allocate what the header claims: every read is bounded by the checked geometry and by
``max_poll`` records.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from greyhound.hookabi.layout import (
    BENCH_MAX_REPEAT,
    BENCH_SLOT_DTYPE,
    COMM_DTYPE,
    CONTROL_DTYPE,
    FINAL_BENCH_STATES,
    PAUSE_LEASE_MAX_MS,
    RECORD_DTYPE,
    BenchKind,
    BenchRequest,
    BenchResult,
    BenchState,
    CommState,
    Flag,
    GpuApi,
    Mode,
    ModeName,
    RingHeader,
    unsigned64,
)
from greyhound.hookabi.ringfile import FileId, RingFile
from greyhound.hookabi.validation import RingError

_GPU_PENDING = int(Flag.PROFILED)
_GPU_SETTLED = int(Flag.GPU_DONE | Flag.GPU_LOST | Flag.ABORTED)
# How long the agent's reader holds a profiled record for its GPU times (RingReader.gpu_wait_ns):
# a call's GPU end comes up to an iteration after its host return (the host runs ahead), more
# when the iteration is long, so this many of the rank's recent iterations, within [MIN, MAX]
# seconds. The simulator's live mode holds its profiled records by the same rule.
PROFILE_WAIT_ITERATIONS = 4
MIN_PROFILE_WAIT_S = 2.0
MAX_PROFILE_WAIT_S = 120.0


def profile_wait_s(recent_iteration_s: float) -> float:
    """The GPU-times wait for a rank whose longest recent iteration took ``recent_iteration_s``."""
    return min(max(PROFILE_WAIT_ITERATIONS * recent_iteration_s, MIN_PROFILE_WAIT_S),
               MAX_PROFILE_WAIT_S)


# Records handed out by one poll: 8 MiB of copies at most, whatever the ring's size or lag.
MAX_POLL_RECORDS = 1 << 16
# No real ring reaches 2^62 records (a billion calls a second for 146 years).
_MAX_INDEX = 1 << 62
_CLAIMING = 0xFFFFFFFF  # a progress slot being claimed: not yet whole


def _field(name: str) -> tuple[int, np.dtype[np.generic]]:
    dtype, offset = CONTROL_DTYPE.fields[name][:2]  # type: ignore[index]
    return int(offset), dtype


_MODE, _PAUSE_REQUEST, _PAUSE_COMM, _PAUSE_SEQ, _PAUSE_LEASE, _JOB_TIMEOUT = (
    _field(n) for n in ("mode", "pause_request", "pause_comm_id", "pause_seq", "pause_lease_ns",
                        "job_timeout_ms"))
_MAX_TIMEOUT_MS = (1 << 32) - 1
_SLOTS_AT = _field("slots")[0]
_STATE_AT = int(BENCH_SLOT_DTYPE.fields["state"][1])  # type: ignore[index]


def _put(ring: RingFile, where: tuple[int, np.dtype[np.generic]], value: int) -> None:
    ring.write_control(where[0], np.array(value, where[1]))


def _gpu_api(value: int) -> GpuApi:
    try:
        return GpuApi(value)
    except ValueError:  # no hook writes it: say nothing rather than guess
        return GpuApi.UNKNOWN


def _header(ring: RingFile) -> RingHeader:
    h = ring.header()
    return RingHeader(
        version=int(h["version"]),
        job=bytes(h["job"].item()).decode(errors="replace"),
        rank=ring.geometry.rank,  # as checked on open: a header rewritten later cannot move it
        host=bytes(h["host"].item()).decode(errors="replace"),
        pid=int(h["pid"]),
        device=int(h["device"]),
        capacity=ring.geometry.capacity,
        head=int(h["head"]),
        dropped=int(h["dropped"]),
        mono_anchor_ns=int(h["mono_anchor_ns"]),
        wall_anchor_ns=int(h["wall_anchor_ns"]),
        gpu_api=_gpu_api(int(h["gpu_api"])),
        pci_bus_id=bytes(h["pci_bus_id"].item()).decode("ascii", errors="replace"),
    )


class Control:
    """The agent's side of a rank's control block: mode, pause/resume and benchmark requests.

    Made from a path it opens its own file; from a RingReader it shares the reader's, so it
    acts on the very file the reader drains (see RingReader.control) and fails once that file
    is closed, instead of writing into whatever file took its place at the path.
    """

    def __init__(self, ring: Path | RingFile) -> None:
        self._owns = not isinstance(ring, RingFile)
        self._ring = RingFile(Path(ring)) if not isinstance(ring, RingFile) else ring
        ids = self._slots()["req_id"]
        top = int(ids.max())
        self._next_id = top + 1 if top < _MAX_INDEX else 1  # a nonsense id must not overflow

    @property
    def file_id(self) -> FileId:
        return self._ring.id

    def _slots(self) -> np.ndarray:
        slots: np.ndarray = self._ring.control_block()["slots"]
        return slots

    def set_mode(self, mode: ModeName) -> None:
        _put(self._ring, _MODE, int(Mode[mode.upper()]))

    def pause(self, comm_id: int = 0, seq: int = 0, *, lease_s: float | None = None) -> None:
        """Park the training thread at its next NCCL call, or, with comm_id, at the entry of the
        call on that communicator whose collective seq would be >= seq. Pausing several ranks
        needs the targeted form with one (comm_id, seq) for all of them, seq beyond every rank's
        last_seq_entered (see comms()): a rank parked early would leave its peers blocked inside
        the collective it never entered.

        The pause is a lease: the hook resumes by itself lease_s from now (None: its default
        lease from when it sees the request), whatever becomes of the caller. Calling pause
        again with the same target renews it."""
        if not 0 <= seq < _MAX_INDEX:
            raise ValueError(f"pause seq {seq} is out of range")
        if lease_s is not None and not 0 < lease_s <= PAUSE_LEASE_MAX_MS / 1000:
            raise ValueError(f"lease_s must be in (0, {PAUSE_LEASE_MAX_MS / 1000:g}]")
        _put(self._ring, _PAUSE_COMM, unsigned64(comm_id))
        _put(self._ring, _PAUSE_SEQ, seq)
        # CLOCK_MONOTONIC, as the hook reads it (one host, one clock)
        _put(self._ring, _PAUSE_LEASE, 0 if lease_s is None else (
            time.monotonic_ns() + round(lease_s * 1e9)))
        _put(self._ring, _PAUSE_REQUEST, 1)  # last: the hook acts on this store

    def paused(self) -> bool:
        return bool(self._ring.control_block()["paused"])

    def job_timeout_s(self) -> float | None:
        """The job's collective (process-group) timeout as the rank reported it, None unknown.
        A pause of that rank never lasts longer than PAUSE_TIMEOUT_SHARE of it."""
        ms = int(self._ring.control_block()["job_timeout_ms"])
        return ms / 1000 if ms else None

    def report_job_timeout(self, seconds: float) -> None:
        """Write the job's collective timeout into the control block (the framework integration,
        in the training process, for a ring made before it knew the timeout)."""
        if not 0 < seconds * 1000 <= _MAX_TIMEOUT_MS:
            raise ValueError(f"job timeout {seconds!r} s is out of range")
        _put(self._ring, _JOB_TIMEOUT, max(1, round(seconds * 1000)))

    def resume(self) -> None:
        _put(self._ring, _PAUSE_REQUEST, 0)

    def submit(self, req: BenchRequest) -> int:
        if not 1 <= req.repeat <= BENCH_MAX_REPEAT:
            raise ValueError(f"repeat must be in 1..{BENCH_MAX_REPEAT}")
        sized = req.kind in (BenchKind.GEMM, BenchKind.SEND, BenchKind.RECV)
        if not (req.size > 0 if sized else req.size == 0) or req.size >= _MAX_INDEX:
            raise ValueError(f"benchmark size {req.size} is out of range for {req.kind.name}")
        if not -1 <= req.peer < 1 << 31:
            raise ValueError(f"benchmark peer {req.peer} is out of range")
        free = np.flatnonzero(self._slots()["state"] == BenchState.EMPTY)
        if free.size == 0:
            raise RuntimeError("all benchmark slots are busy; collect results first")
        index = int(free[0])
        req_id = self._next_id
        self._next_id += 1
        slot = np.zeros((), BENCH_SLOT_DTYPE)  # state EMPTY: the hook ignores it until below
        slot["kind"] = int(req.kind)
        slot["comm_id"] = unsigned64(req.comm_id)
        slot["size"] = req.size
        slot["peer"] = req.peer
        slot["repeat"] = req.repeat
        slot["req_id"] = req_id
        at = _SLOTS_AT + index * BENCH_SLOT_DTYPE.itemsize
        self._ring.write_control(at, slot)
        self._ring.write_control(at + _STATE_AT, np.array(BenchState.SUBMITTED, "<u4"))
        return req_id

    def result(self, req_id: int) -> BenchResult | None:
        """The final result of a request (its slot is then freed), or None while pending."""
        slots = self._slots()
        hit = np.flatnonzero(slots["req_id"] == req_id)
        if hit.size == 0:
            raise KeyError(req_id)
        index = int(hit[0])
        slot = slots[index]
        try:
            state = BenchState(int(slot["state"]))
        except ValueError:  # a state no hook writes: give the slot back as failed
            state = BenchState.FAILED
        if state not in FINAL_BENCH_STATES:
            return None
        n = min(int(slot["n_done"]), BENCH_MAX_REPEAT)
        out = BenchResult(
            req_id=req_id,
            state=state,
            result=int(slot["result"]),
            durations_ns=tuple(int(d) for d in slot["durations_ns"][:n]),
            drain_ns=int(slot["drain_ns"]),
        )
        at = _SLOTS_AT + index * BENCH_SLOT_DTYPE.itemsize + _STATE_AT
        self._ring.write_control(at, np.array(BenchState.EMPTY, "<u4"))
        return out

    def close(self) -> None:
        if self._owns:
            self._ring.close()



class RingReader:
    """The single consumer of one rank's ring.

    poll() hands out complete records in slot order and publishes the consumed cursor (which is
    what lets the hook reuse slots). A profiled record is held back until the poller has written
    its GPU times, for at most gpu_wait_ns after its return (the agent raises it to several of
    the job's iterations: a call's GPU end comes an iteration or more after its host return) and
    only while the ring is less than half full (the hook drops records it has no room for), so
    callers see each record once and in final form. A slot reserved by a writer that never
    completed it (a killed thread) is skipped after stuck_ns and counted in `lost`, with the
    records the hook dropped.

    A record is taken on its stamp, and its fields are read after the stamp was seen, never in
    the same copy: a bulk copy may read a slot's words in any order, so a stamp read in it says
    nothing of the fields beside it. The same goes for the GPU times the poller writes later:
    the flags that say they are there come from the first read.

    A head behind the cursor or more than the capacity ahead of it is no state a hook can write
    (it reserves slots only while head - consumed < capacity): poll() raises a RingError.
    """

    def __init__(
        self, path: Path, *, gpu_wait_ns: int = 2_000_000_000, stuck_ns: int = 1_000_000_000,
        max_poll: int = MAX_POLL_RECORDS, dir_fd: int | None = None,
    ) -> None:
        self._ring = RingFile(path, dir_fd=dir_fd)
        try:
            self.header = _header(self._ring)
            self._cursor = self._ring.consumed()
            if self._cursor >= _MAX_INDEX:
                raise RingError(path, "head", f"consumed cursor {self._cursor} is nonsense")
        except BaseException:
            self._ring.close()
            raise
        self._skipped = 0
        self.torn = 0  # comm-table rows left out of a sample: caught mid-update every time
        self.gpu_wait_ns = gpu_wait_ns
        self._stuck_ns = stuck_ns
        self._max_poll = max_poll
        self._stuck_at: tuple[int, int] | None = None  # (cursor, first seen monotonic ns)

    @property
    def path(self) -> Path:
        return self._ring.path

    @property
    def file_id(self) -> FileId:
        return self._ring.id

    @property
    def owner(self) -> int:
        """The uid that owns the ring file."""
        return self._ring.owner

    @property
    def lost(self) -> int:
        return int(self._ring.header()["dropped"]) + self._skipped

    @property
    def cursor(self) -> int:
        return self._cursor

    def refresh_header(self) -> RingHeader:
        self.header = _header(self._ring)
        return self.header

    def control_block(self) -> np.ndarray:
        """A copy of the control block (CONTROL_DTYPE), e.g. to read pause_count."""
        return self._ring.control_block()

    def _lag(self) -> int:
        head = self._ring.head()
        n = head - self._cursor
        if head >= _MAX_INDEX or n < 0 or n > self._ring.geometry.capacity:
            raise RingError(self.path, "head", f"head {head} with the cursor at {self._cursor}: "
                                               "no hook writes that")
        return n

    def poll(self, max_records: int | None = None) -> np.ndarray:
        n = min(self._lag(), self._max_poll)
        if max_records is not None:
            n = min(n, max_records)
        if n <= 0:
            return np.empty(0, RECORD_DTYPE)
        lag = n
        seen = self._ring.records(self._cursor, n)  # stamps and flags only count from here
        expect = np.arange(self._cursor + 1, self._cursor + n + 1, dtype=np.uint64)
        bad = seen["stamp"] != expect
        now = time.monotonic_ns()
        flags = seen["flags"]
        if lag < self._ring.geometry.capacity // 2:
            bad |= ((flags & _GPU_PENDING) != 0) & ((flags & _GPU_SETTLED) == 0) & (
                seen["return_ns"].astype(np.int64) > now - self.gpu_wait_ns
            )
        take = int(np.argmax(bad)) if bad.any() else n
        if take == 0 and seen["stamp"][0] != expect[0]:
            take = self._skip_if_stuck(now)
        else:
            self._stuck_at = None
        if take == 0:
            return np.empty(0, RECORD_DTYPE)
        # Published records: their slots stay theirs until the cursor moves, so this copy holds
        # what was written before each stamp the first one saw.
        batch = self._ring.records(self._cursor, take)
        batch["flags"] = flags[:take]
        self._cursor += take
        self._ring.set_consumed(self._cursor)
        return batch

    def _skip_if_stuck(self, now: int) -> int:
        if self._stuck_at is None or self._stuck_at[0] != self._cursor:
            self._stuck_at = (self._cursor, now)
            return 0
        if now - self._stuck_at[1] < self._stuck_ns:
            return 0
        self._skipped += 1
        self._cursor += 1
        self._ring.set_consumed(self._cursor)
        self._stuck_at = None
        return 0

    def comms(self, tries: int = 8) -> np.ndarray:
        """Comm-table rows in use, each as one consistent snapshot (the agent sanitises what it
        sends). A row is read between two reads of its seqlock words (each its own read, so
        the row's copy lies between them) that find them even and unchanged: no writer was
        inside it meanwhile. A row caught mid-update ``tries`` times running is left out of this
        sample and counted in ``torn``."""
        table = self._ring.comm_table()
        rows = []
        for i in np.flatnonzero(table["state"] != CommState.FREE).tolist():
            for _ in range(tries):
                before = self._ring.comm_versions(i)
                row = self._ring.comm_row(i)
                odd = (before[0] | before[1] | before[2]) & 1
                if before == self._ring.comm_versions(i) and not odd:
                    if int(row["state"]) != CommState.FREE:
                        rows.append(row)
                    break
            else:
                self.torn += 1
        out: np.ndarray = np.array(rows, dtype=COMM_DTYPE)
        return out

    def progress(self) -> np.ndarray:
        """A copy of the profiler plugin's region (PROGRESS_DTYPE): per (communicator, channel,
        peer, direction) network step counters and per (communicator, channel) kernel starts and
        stops. Slots name their communicator by comm table index (``key & 0xff`` - 1)."""
        return self._ring.progress()

    def progress_rows(self) -> dict[str, np.ndarray]:
        """The plugin's slots in use, decoded: per slot its communicator (``comm_id``, and this
        rank's ``comm_rank`` in it, from the comm table row the key names), ``kind`` (ProgDir,
        or 2 for a kernel channel), ``channel``, ``peer`` (comm rank; -1 kernel), ``posted`` /
        ``done`` (steps; kernel: starts / stops), ``bytes``, ``net_ns``, ``last_ns``, ``seq``.
        Slots whose row is free or was taken by another communicator are left out."""
        g = self.progress()
        table = self._ring.comm_table()
        slots, kch = g["slots"], g["kch"]
        used = (slots["key"] != 0) & (slots["key"] != _CLAIMING)
        kused = (kch["key"] != 0) & (kch["key"] != _CLAIMING)
        s, k = slots[used], kch[kused]
        keys = np.concatenate((s["key"], k["key"])).astype(np.int64)
        idx = (keys & 0xFF) - 1
        ok = (idx >= 0) & (idx < len(table))
        row = table[np.clip(idx, 0, len(table) - 1)]
        ok &= row["state"] != CommState.FREE
        out = {
            "comm_id": row["comm_id"].astype(np.uint64),
            "comm_rank": row["rank"].astype(np.int64),
            "kind": np.concatenate(((s["key"].astype(np.int64) >> 16) & 1,
                                    np.full(len(k), 2, np.int64))),
            "channel": (keys >> 8) & 0xFF,
            "peer": np.concatenate((s["peer"].astype(np.int64), np.full(len(k), -1, np.int64))),
            "posted": np.concatenate((s["steps_posted"], k["starts"].astype(np.uint64))),
            "done": np.concatenate((s["steps_done"], k["stops"].astype(np.uint64))),
            "bytes": np.concatenate((s["bytes"], np.zeros(len(k), np.uint64))),
            "net_ns": np.concatenate((s["net_ns"], np.zeros(len(k), np.uint64))),
            "last_ns": np.concatenate((s["last_ns"], k["last_ns"])),
            "seq": np.concatenate((s["seq"], np.zeros(len(k), np.uint64))),
        }
        return {name: col[ok] for name, col in out.items()}

    def want_classes(self, mask: int) -> None:
        """Ask the rank's profiler plugin for these event classes (NCCL's mask bits, e.g.
        ``ProfileClass.PROXY_STEP``) on top of its default ones; 0 goes back to the default. The
        hook applies it within a few milliseconds, to operations enqueued from then on."""
        self._ring.write_mask_extra(mask)

    def control(self) -> Control:
        """The control block of this very file (shared descriptor, see Control)."""
        return Control(self._ring)

    def close(self) -> None:
        self._ring.close()
