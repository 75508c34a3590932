"""The collector reads the GPU completion marks of layout 3 from a real ring file and publishes
them as CounterBatch columns; a communicator without marks publishes zeros there. Profiled
records keep GPU times only where the hook marked them GPU_DONE."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from greyhound.core.job_hangs import COUNTER_FIELDS, JobHangMonitor
from greyhound.hookabi import (
    COMM_DTYPE,
    HEADER_DTYPE,
    MAX_COMMS,
    RECORD_DTYPE,
    CommRow,
    CommState,
    Flag,
    Op,
    RingWriter,
)
from services.agent.collector import CollectiveRows, Collector
from services.common.bus.contract import CounterBatch

JOB = "gpumarks"
MARKED, HOST_ONLY, GONE = 0x1234, (1 << 64) - 5, 0x77


def _calls(comm: int, n: int) -> np.ndarray:
    recs = np.zeros(n, RECORD_DTYPE)
    recs["comm_id"] = comm
    recs["op"] = Op.ALLREDUCE
    recs["seq"] = np.arange(1, n + 1)
    recs["count"] = 1 << 20
    recs["datatype"] = 7
    recs["nranks"] = 4
    recs["comm_rank"] = 3
    return recs


def _comm_table(path: Path) -> np.memmap:
    """The ring's communicator entries through a plain mapping of the file, as the hook's
    poller thread would write them."""
    hdr = np.fromfile(path, HEADER_DTYPE, count=1)[0]
    return np.memmap(path, COMM_DTYPE, mode="r+", offset=int(hdr["comms_offset"]),
                     shape=(MAX_COMMS,))


def test_gpu_fields_of_a_ring_become_counter_columns(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    writer = RingWriter(shm / JOB / "rank-3.ring", job=JOB, rank=3, host="h", pid=0, device=0,
                        capacity=64, comms=[CommRow(c, 3, 4) for c in (MARKED, HOST_ONLY, GONE)])
    writer.append(np.concatenate((_calls(MARKED, 12), _calls(HOST_ONLY, 5), _calls(GONE, 2))))
    now = time.monotonic_ns()
    table = _comm_table(writer.path)
    for cid, n in ((MARKED, 12), (HOST_ONLY, 5), (GONE, 2)):  # the hook's host counters
        row = table[int(np.flatnonzero(table["comm_id"] == cid)[0])]
        row["calls_entered"] = row["calls_completed"] = n
        row["last_seq_entered"] = row["last_seq_completed"] = n
        row["last_op"] = Op.ALLREDUCE
    marked = int(np.flatnonzero(table["comm_id"] == MARKED)[0])
    host_only = int(np.flatnonzero(table["comm_id"] == HOST_ONLY)[0])
    e = table[marked]
    e["gpu_marks"], e["gpu_calls_done"], e["gpu_seq_done"] = 1, 9, 9
    e["gpu_pending_ns"], e["gpu_pending_seq"] = now - 5_000_000_000, 10
    e["gpu_pending_op"], e["gpu_pending_dtype"], e["gpu_pending_count"] = Op.ALLGATHER, 9, 777
    h = table[host_only]
    h["gpu_marks"], h["gpu_seq_done"], h["gpu_pending_ns"] = 0, 4, now - 9_000_000_000
    h["inflight_enter_ns"] = now - 2_000_000_000
    g = table[int(np.flatnonzero(table["comm_id"] == GONE)[0])]
    g["gpu_marks"], g["gpu_pending_ns"], g["state"] = 1, now - 9_000_000_000, CommState.DESTROYED
    table.flush()
    del table

    col = Collector(shm, JOB)
    assert len(col.scan()) == 1
    rows = col.counters(now + 1_000_000_000)
    col.close()
    writer.close()
    at = {cid: i for i, cid in enumerate(rows.comm_id)}
    m, o, d = at[MARKED], at[HOST_ONLY], at[GONE]
    assert rows.gpu_marks[d] == 1 and rows.gpu_pending_s[d] == 0.0  # destroyed: abandoned
    assert rows.rank == [3, 3, 3] and rows.last_seq_entered[m] == 12 and rows.inflight_s[m] == 0.0
    assert rows.gpu_marks[m] == 1 and rows.gpu_completed[m] == 9
    assert rows.gpu_seq_completed[m] == 9 and rows.gpu_pending_seq[m] == 10
    assert abs(rows.gpu_pending_s[m] - 6.0) < 1e-6
    assert (rows.gpu_pending_op[m], rows.gpu_pending_dtype[m], rows.gpu_pending_count[m]) == (
        Op.ALLGATHER, 9, 777)
    # without marks: the host's time inside NCCL, and no stale GPU values
    assert rows.gpu_marks[o] == 0 and abs(rows.inflight_s[o] - 3.0) < 1e-6
    assert (rows.gpu_seq_completed[o], rows.gpu_pending_s[o], rows.gpu_pending_seq[o]) == (0, 0, 0)

    batch = CounterBatch(job_id=JOB, agent_id="a", sampled_ns=time.time_ns(), **vars(rows))
    assert set(COUNTER_FIELDS) == set(CounterBatch.COLUMNS)
    mon = JobHangMonitor(floor_s=5.0)
    mon.observe_counters(100.0, {f: getattr(batch, f) for f in COUNTER_FIELDS})
    (found,) = mon.check(100.0)
    assert found.comm_id == MARKED and found.basis == "gpu" and found.stalled_s > 5.0


def test_profiled_rows_keep_gpu_times_only_where_the_gpu_timed_them() -> None:
    recs = _calls(MARKED, 3)
    recs["enter_ns"] = [100, 200, 300]
    recs["return_ns"] = [101, 201, 301]
    recs["gpu_start_ns"] = [150, 250, 350]
    recs["gpu_end_ns"] = [160, 260, 360]
    recs["flags"] = [Flag.PROFILED | Flag.GPU_DONE, Flag.PROFILED | Flag.GPU_LOST, Flag.CAPTURED]
    rows = CollectiveRows()
    rows.add(3, recs, wall_offset_ns=1_000)
    assert rows.enter_ns == [1100, 1200, 1300]
    assert rows.gpu_start_ns == [1150, 0, 0] and rows.gpu_end_ns == [1160, 0, 0]


def _profiled_ring(tmp_path: Path, *, marks: int) -> tuple[Collector, RingWriter]:
    """A ring whose first two calls were enqueued in monitor mode (no flags) and whose last
    three were handled in profile mode (timed, lost, captured); the agent keeps records."""
    writer = RingWriter(tmp_path / "shm" / JOB / "rank-0.ring", job=JOB, rank=0, host="h", pid=0,
                        device=0, capacity=64, comms=[CommRow(MARKED, 0, 4, gpu_marks=bool(marks))])
    recs = _calls(MARKED, 5)
    recs["flags"] = [0, 0, Flag.PROFILED | Flag.GPU_DONE, Flag.PROFILED | Flag.GPU_LOST,
                     Flag.CAPTURED]
    writer.append(recs)
    col = Collector(tmp_path / "shm", JOB)
    (stream,) = col.scan()
    stream.keep_records = True
    return col, writer


def test_a_profile_window_leaves_out_calls_enqueued_before_the_switch(tmp_path: Path) -> None:
    col, writer = _profiled_ring(tmp_path, marks=1)
    col.drain()
    assert col.take_profiled().seq == [3, 4, 5]  # the two monitor-mode calls are not host-only rows
    col.close()
    writer.close()


def test_a_host_only_process_keeps_every_call_of_its_window(tmp_path: Path) -> None:
    col, writer = _profiled_ring(tmp_path, marks=0)
    col.drain()
    assert col.take_profiled().seq == [1, 2, 3, 4, 5]  # no CUDA: host time is all there is
    col.close()
    writer.close()
