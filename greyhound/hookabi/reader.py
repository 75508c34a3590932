"""The agent's side of a ring: records out (RingReader), requests in (Control)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from greyhound.hookabi.layout import (
    BENCH_MAX_REPEAT,
    FINAL_BENCH_STATES,
    PAUSE_LEASE_MAX_MS,
    RECORD_DTYPE,
    BenchRequest,
    BenchResult,
    BenchState,
    CommState,
    Flag,
    Mode,
    ModeName,
    RingHeader,
)
from greyhound.hookabi.mapping import RingMapping

_GPU_PENDING = int(Flag.PROFILED)
_GPU_SETTLED = int(Flag.GPU_DONE | Flag.GPU_LOST | Flag.ABORTED)


class Control:
    """The agent's side of a rank's control block: mode, pause/resume and benchmark requests."""

    def __init__(self, path: Path) -> None:
        self._map = RingMapping(path)
        self._ctl = self._map.ctl
        slots = self._ctl["slots"]
        self._next_id = int(slots["req_id"].max()) + 1

    def set_mode(self, mode: ModeName) -> None:
        self._ctl["mode"] = int(Mode[mode.upper()])

    def pause(self, comm_id: int = 0, seq: int = 0, *, lease_s: float | None = None) -> None:
        """Park the training thread at its next NCCL call, or, with comm_id, at the entry of the
        call on that communicator whose collective seq would be >= seq. Pausing several ranks
        needs the targeted form with one (comm_id, seq) for all of them, seq beyond every rank's
        last_seq_entered (see comms()): a rank parked early would leave its peers blocked inside
        the collective it never entered.

        The pause is a lease: the hook resumes by itself lease_s from now (None: its default
        lease from when it sees the request), whatever becomes of the caller. Calling pause
        again with the same target renews it."""
        if lease_s is not None and not 0 < lease_s <= PAUSE_LEASE_MAX_MS / 1000:
            raise ValueError(f"lease_s must be in (0, {PAUSE_LEASE_MAX_MS / 1000:g}]")
        self._ctl["pause_comm_id"] = comm_id
        self._ctl["pause_seq"] = seq
        # CLOCK_MONOTONIC, as the hook reads it (one host, one clock)
        self._ctl["pause_lease_ns"] = 0 if lease_s is None else (
            time.monotonic_ns() + round(lease_s * 1e9))
        self._ctl["pause_request"] = 1  # last: the hook acts on this store

    def paused(self) -> bool:
        return bool(self._ctl["paused"])

    def resume(self) -> None:
        self._ctl["pause_request"] = 0

    def submit(self, req: BenchRequest) -> int:
        if not 1 <= req.repeat <= BENCH_MAX_REPEAT:
            raise ValueError(f"repeat must be in 1..{BENCH_MAX_REPEAT}")
        slots = self._ctl["slots"]
        free = np.flatnonzero(slots["state"] == BenchState.EMPTY)
        if free.size == 0:
            raise RuntimeError("all benchmark slots are busy; collect results first")
        slot = slots[int(free[0])]
        req_id = self._next_id
        self._next_id += 1
        slot["kind"] = int(req.kind)
        slot["comm_id"] = req.comm_id
        slot["size"] = req.size
        slot["peer"] = req.peer
        slot["repeat"] = req.repeat
        slot["result"] = 0
        slot["n_done"] = 0
        slot["total_ns"] = 0
        slot["req_id"] = req_id
        slot["state"] = int(BenchState.SUBMITTED)  # last: the hook acts on this store
        return req_id

    def result(self, req_id: int) -> BenchResult | None:
        """The final result of a request (its slot is then freed), or None while pending."""
        slots = self._ctl["slots"]
        hit = np.flatnonzero(slots["req_id"] == req_id)
        if hit.size == 0:
            raise KeyError(req_id)
        slot = slots[int(hit[0])]
        state = BenchState(int(slot["state"]))
        if state not in FINAL_BENCH_STATES:
            return None
        n = int(slot["n_done"])
        out = BenchResult(
            req_id=req_id,
            state=state,
            result=int(slot["result"]),
            durations_ns=tuple(int(d) for d in slot["durations_ns"][:n]),
            drain_ns=int(slot["drain_ns"]),
        )
        slot["state"] = int(BenchState.EMPTY)
        return out

    def close(self) -> None:
        del self._ctl
        self._map.close()


class RingReader:
    """The single consumer of one rank's ring.

    poll() hands out complete records in slot order and publishes the consumed cursor (which is
    what lets the hook reuse slots). A profiled record is held back until the poller has written
    its GPU times, or for at most gpu_wait_ns after its return, so callers see each record once
    and in final form. A slot reserved by a writer that never completed it (a killed thread) is
    skipped after stuck_ns and counted in `lost`, with the records the hook dropped.
    """

    def __init__(
        self, path: Path, *, gpu_wait_ns: int = 2_000_000_000, stuck_ns: int = 1_000_000_000
    ) -> None:
        self._map = RingMapping(path)
        self.header = self._map.header()
        self._cursor = int(self._map.hdr["consumed"])
        self._skipped = 0
        self._gpu_wait_ns = gpu_wait_ns
        self._stuck_ns = stuck_ns
        self._stuck_at: tuple[int, int] | None = None  # (cursor, first seen monotonic ns)

    @property
    def path(self) -> Path:
        return self._map.path

    @property
    def lost(self) -> int:
        return int(self._map.hdr["dropped"]) + self._skipped

    @property
    def cursor(self) -> int:
        return self._cursor

    def refresh_header(self) -> RingHeader:
        self.header = self._map.header()
        return self.header

    def poll(self, max_records: int | None = None) -> np.ndarray:
        head = int(self._map.hdr["head"])
        n = head - self._cursor
        if max_records is not None:
            n = min(n, max_records)
        if n <= 0:
            return np.empty(0, RECORD_DTYPE)
        batch = self._map.slice_copy(self._cursor, n)
        expect = np.arange(self._cursor + 1, self._cursor + n + 1, dtype=np.uint64)
        bad = batch["stamp"] != expect
        now = time.monotonic_ns()
        flags = batch["flags"]
        bad |= ((flags & _GPU_PENDING) != 0) & ((flags & _GPU_SETTLED) == 0) & (
            batch["return_ns"].astype(np.int64) > now - self._gpu_wait_ns
        )
        take = int(np.argmax(bad)) if bad.any() else n
        if take == 0 and batch["stamp"][0] != expect[0]:
            take = self._skip_if_stuck(now)
            batch = batch[:take]
        else:
            self._stuck_at = None
            batch = batch[:take]
        if take:
            self._cursor += take
            self._map.hdr["consumed"] = self._cursor
        return batch

    def _skip_if_stuck(self, now: int) -> int:
        if self._stuck_at is None or self._stuck_at[0] != self._cursor:
            self._stuck_at = (self._cursor, now)
            return 0
        if now - self._stuck_at[1] < self._stuck_ns:
            return 0
        self._skipped += 1
        self._cursor += 1
        self._map.hdr["consumed"] = self._cursor
        self._stuck_at = None
        return 0

    def comms(self) -> np.ndarray:
        table = self._map.comm_table
        rows: np.ndarray = table[table["state"] != CommState.FREE].copy()
        return rows

    def control(self) -> Control:
        return Control(self._map.path)

    def close(self) -> None:
        self._map.close()
