"""The hook's side of the ring layout, in Python: the simulator plays simulated ranks with it.

It writes exactly what native/hook writes (same header, comm counters, drop rule and control
block answers), so the agent cannot tell a simulated rank from a hooked process. Import it as
`greyhound.hookabi.RingWriter`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from greyhound.hookabi import (
    BENCH_SLOTS,
    COLLECTIVE_OPS,
    COMM_DTYPE,
    CONTROL_DTYPE,
    HEADER_BYTES,
    HEADER_DTYPE,
    LAYOUT_VERSION,
    MAGIC,
    MAX_COMMS,
    MAX_PEERS,
    RECORD_DTYPE,
    BenchKind,
    BenchRequest,
    BenchState,
    CommState,
    Op,
    _Mapping,
)


def _page_up(n: int) -> int:
    return (n + 4095) & ~4095


class HookControl:
    """What a hooked rank does with its control block: read mode/pause, answer benchmarks."""

    def __init__(self, ctl: np.ndarray) -> None:
        self._ctl = ctl

    @property
    def mode(self) -> str:
        return "profile" if int(self._ctl["mode"]) == 1 else "monitor"

    def pause_requested(self) -> bool:
        return bool(self._ctl["pause_request"])

    def pause_target(self) -> tuple[int, int]:
        """(comm_id, seq) of a targeted pause; (0, 0) means the next call."""
        return int(self._ctl["pause_comm_id"]), int(self._ctl["pause_seq"])

    def set_paused(self, paused: bool, tid: int = 0) -> None:
        if paused:
            self._ctl["paused_tid"] = tid
            self._ctl["pause_count"] += 1
        self._ctl["paused"] = int(paused)

    def pending(self) -> list[tuple[int, BenchRequest]]:
        """Submitted requests, lowest id first (the order the hook runs them in)."""
        slots = self._ctl["slots"]
        out = []
        for i in np.flatnonzero(slots["state"] == BenchState.SUBMITTED):
            s = slots[int(i)]
            req = BenchRequest(kind=BenchKind(int(s["kind"])), size=int(s["size"]),
                               repeat=int(s["repeat"]), comm_id=int(s["comm_id"]),
                               peer=int(s["peer"]))
            out.append((int(s["req_id"]), req))
        return sorted(out, key=lambda t: t[0])

    def answer(self, req_id: int, state: BenchState, durations_ns: list[int],
               result: int = 0, drain_ns: int = 0) -> None:
        slots = self._ctl["slots"]
        hit = np.flatnonzero(slots["req_id"] == req_id)
        if hit.size == 0:
            raise KeyError(req_id)
        s = slots[int(hit[0])]
        n = min(len(durations_ns), s["durations_ns"].shape[0])
        s["durations_ns"][:n] = durations_ns[:n]
        s["n_done"] = n
        s["total_ns"] = int(sum(durations_ns[:n]))
        s["result"] = result
        s["drain_ns"] = drain_ns
        s["state"] = int(state)


def write_records(ring: _Mapping, records: np.ndarray) -> int:
    """Put RECORD_DTYPE rows into a mapped ring as the hook does: what does not fit is dropped
    and counted, and each slot's stamp is set only after its body, so a reader never takes a
    half-written record. Returns how many were written."""
    hdr = ring.hdr
    head = int(hdr["head"])
    free = ring.capacity - (head - int(hdr["consumed"]))
    keep = records[: max(free, 0)]
    if len(keep) < len(records):
        hdr["dropped"] += len(records) - len(keep)
    if len(keep) == 0:
        return 0
    idx = np.arange(head, head + len(keep), dtype=np.uint64)
    slots = (idx & np.uint64(ring.capacity - 1)).astype(np.int64)
    body = keep.copy()
    body["stamp"] = 0
    ring.records[slots] = body
    ring.records["stamp"][slots] = idx + np.uint64(1)
    hdr["head"] = head + len(keep)
    return len(keep)


class RingWriter:
    """Creates the ring file (temporary name, then rename) and appends records to it."""

    def __init__(self, path: Path, *, job: str, rank: int, host: str, pid: int, device: int,
                 capacity: int) -> None:
        if capacity < 16 or capacity & (capacity - 1):
            raise ValueError("capacity must be a power of two >= 16")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        control_off = HEADER_BYTES
        comms_off = _page_up(control_off + CONTROL_DTYPE.itemsize)
        records_off = _page_up(comms_off + MAX_COMMS * COMM_DTYPE.itemsize)
        size = records_off + capacity * RECORD_DTYPE.itemsize
        tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
        with open(tmp, "wb") as f:
            f.truncate(size)
        hdr = np.zeros((), HEADER_DTYPE)
        hdr["magic"] = MAGIC
        hdr["version"] = LAYOUT_VERSION
        hdr["header_bytes"] = HEADER_BYTES
        hdr["capacity"] = capacity
        hdr["record_bytes"] = RECORD_DTYPE.itemsize
        hdr["max_comms"] = MAX_COMMS
        hdr["max_peers"] = MAX_PEERS
        hdr["control_offset"] = control_off
        hdr["comms_offset"] = comms_off
        hdr["records_offset"] = records_off
        hdr["file_bytes"] = size
        hdr["job"] = job.encode()[:63]
        hdr["host"] = host.encode()[:63]
        hdr["rank"] = rank
        hdr["pid"] = pid
        hdr["device"] = device
        hdr["mono_anchor_ns"] = time.monotonic_ns()
        hdr["wall_anchor_ns"] = time.time_ns()
        hdr["ready"] = 1
        with open(tmp, "r+b") as f:
            f.write(hdr.tobytes())
        os.replace(tmp, path)
        self._map = _Mapping(path)
        self._table = self._map.comm_table

    @property
    def path(self) -> Path:
        return self._map.path

    @property
    def head(self) -> int:
        return int(self._map.hdr["head"])

    @property
    def dropped(self) -> int:
        return int(self._map.hdr["dropped"])

    def append(self, records: np.ndarray) -> None:
        """Append RECORD_DTYPE rows (stamps are set here); drop what does not fit, like the hook."""
        if records.dtype != RECORD_DTYPE:
            if records.dtype.names != RECORD_DTYPE.names:
                raise TypeError("records must have RECORD_DTYPE fields")
            records = records.astype(RECORD_DTYPE)  # e.g. np.concatenate drops the padding
        self._count(records)
        write_records(self._map, records)

    def _row(self, comm_id: int, rank: int, nranks: int) -> np.ndarray | None:
        t = self._table
        hit = np.flatnonzero((t["comm_id"] == comm_id) & (t["state"] == CommState.ACTIVE))
        if hit.size:
            row: np.ndarray = t[int(hit[0])]
            return row
        free = np.flatnonzero(t["state"] == CommState.FREE)
        if free.size == 0:
            return None
        row = t[int(free[0])]
        row["comm_id"] = comm_id
        row["rank"] = rank
        row["nranks"] = nranks
        row["color"] = -1
        row["peer_ids"] = -1
        row["state"] = int(CommState.ACTIVE)
        return row

    def _count(self, records: np.ndarray) -> None:
        """The comm table counters the hook keeps: calls, collective seq, per-peer P2P counts."""
        data = records[(records["op"] >= Op.ALLREDUCE) & (records["op"] <= Op.RECV)]
        for cid in np.unique(data["comm_id"]):
            mine = data[data["comm_id"] == cid]
            row = self._row(int(cid), int(mine["comm_rank"][0]), int(mine["nranks"][0]))
            if row is None:
                continue
            row["calls_entered"] += len(mine)
            row["calls_completed"] += len(mine)
            row["last_op"] = int(mine["op"][-1])
            coll = mine[np.isin(mine["op"], [int(o) for o in COLLECTIVE_OPS])]
            if len(coll):
                row["last_seq_entered"] = max(int(row["last_seq_entered"]), int(coll["seq"].max()))
                row["last_seq_completed"] = row["last_seq_entered"]
            for op, field in ((Op.SEND, "send_count"), (Op.RECV, "recv_count")):
                peers, counts = np.unique(mine["peer"][mine["op"] == op], return_counts=True)
                for peer, n in zip(peers.tolist(), counts.tolist(), strict=True):
                    ids = row["peer_ids"][: int(row["npeers"])]
                    at = np.flatnonzero(ids == peer)
                    if at.size:
                        pi = int(at[0])
                    elif int(row["npeers"]) < MAX_PEERS:
                        pi = int(row["npeers"])
                        row["peer_ids"][pi] = peer
                        row["npeers"] += 1
                    else:
                        continue
                    row[field][pi] += n

    def set_inflight(self, comm_id: int, enter_ns: int, seq: int = 0) -> None:
        """Mark a collective as inside NCCL (enter_ns 0 clears), as the hook does between enter
        and return: a hung call shows as last_seq_entered > last_seq_completed."""
        row = self._row(comm_id, -1, 0)
        if row is not None:
            row["inflight_enter_ns"] = enter_ns
            row["last_seq_entered"] = max(int(row["last_seq_entered"]), seq)

    def control_view(self) -> HookControl:
        return HookControl(self._map.ctl)

    def close(self) -> None:
        del self._table
        self._map.close()


__all__ = ["BENCH_SLOTS", "HookControl", "RingWriter"]
