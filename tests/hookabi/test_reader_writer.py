"""The Python ring: what RingWriter writes, RingReader and Control read back, wrap and drops."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from greyhound import hookabi as H

REPO = Path(__file__).resolve().parents[2]


def _records(n: int, comm_id: int = 7, op: H.Op = H.Op.ALLREDUCE) -> np.ndarray:
    r = np.zeros(n, H.RECORD_DTYPE)
    r["op"] = op
    r["comm_id"] = comm_id
    r["comm_rank"] = 1
    r["nranks"] = 4
    r["seq"] = np.arange(1, n + 1)
    r["enter_ns"] = np.arange(n) * 1000 + 1
    r["return_ns"] = r["enter_ns"] + 500
    return r


def _writer(tmp_path: Path, capacity: int = 64) -> H.RingWriter:
    path = H.ring_path(tmp_path, "simjob", 1)
    return H.RingWriter(path, job="simjob", rank=1, host="node7", pid=123, device=2,
                        capacity=capacity, comms=[H.CommRow(7, 1, 4), H.CommRow(9, 1, 4, (0, 2))])


def test_writer_reader_round_trip_with_wrap_and_drops(tmp_path: Path) -> None:
    w = _writer(tmp_path, capacity=64)
    reader = H.RingReader(H.ring_path(tmp_path, "simjob", 1))
    assert reader.header.job == "simjob" and reader.header.host == "node7"
    assert (reader.header.rank, reader.header.pid, reader.header.device) == (1, 123, 2)
    assert H.list_rings(tmp_path) == [H.ring_path(tmp_path, "simjob", 1)]
    batch = _records(50)
    w.append(batch[:40])
    got = reader.poll(max_records=30)
    assert got["seq"].tolist() == list(range(1, 31))
    w.append(batch[40:])  # wraps around the 64-slot ring
    got = reader.poll()
    assert got["seq"].tolist() == list(range(31, 51))
    assert np.array_equal(got["stamp"], np.arange(31, 51, dtype=np.uint64))
    w.append(_records(100))  # only 64 fit while nobody reads
    assert reader.poll().shape == (64,)
    assert reader.lost == 36 and w.dropped == 36
    reader.close()
    w.close()


def test_registered_communicators_and_rows_written_back(tmp_path: Path) -> None:
    w = _writer(tmp_path)
    assert H.list_rings(tmp_path) == [w.path]  # no temporary left beside it
    comms = H.RingReader(w.path).comms()
    assert comms["comm_id"].tolist() == [7, 9] and comms["nranks"].tolist() == [4, 4]
    assert (comms["state"] == H.CommState.ACTIVE).all() and comms["gpu_marks"].tolist() == [1, 1]
    assert comms["peer_ids"][1][: int(comms["npeers"][1])].tolist() == [0, 2]
    rows = w.rows()
    rows["calls_entered"] = [5, 2]
    rows["last_seq_entered"][0] = 5
    w.set_rows(rows)
    again = H.RingReader(w.path).comms()
    assert again["calls_entered"].tolist() == [5, 2] and int(again["last_seq_entered"][0]) == 5


def test_anchors_given_are_the_anchors_read(tmp_path: Path) -> None:
    w = H.RingWriter(tmp_path / "j" / "rank-0.ring", job="j", rank=0, host="h", pid=1, device=0,
                     capacity=16, mono_anchor_ns=1_000, wall_anchor_ns=5_000)
    header = H.RingReader(w.path).header
    assert header.to_wall_ns(1_500) == 5_500


def test_profiled_records_wait_for_gpu_times(tmp_path: Path) -> None:
    w = _writer(tmp_path)
    reader = H.RingReader(w.path, gpu_wait_ns=10_000_000_000)
    r = _records(3)
    now = time.monotonic_ns()
    r["return_ns"] = now
    r["flags"][1] = int(H.Flag.PROFILED)
    w.append(r)
    assert reader.poll()["seq"].tolist() == [1]  # held at the first record without GPU times
    slot = reader.cursor & 63
    w._map.records["flags"][slot] |= int(H.Flag.GPU_DONE)
    assert reader.poll()["seq"].tolist() == [2, 3]
    w.append(r[1:2])
    impatient = H.RingReader(w.path, gpu_wait_ns=0)  # gives up at once: the record comes as is
    got = impatient.poll()
    assert got.shape == (1,) and not int(got["flags"][0]) & H.Flag.GPU_DONE


def test_unfinished_slot_is_skipped_after_stuck_time(tmp_path: Path) -> None:
    w = _writer(tmp_path)
    w.append(_records(3))
    reader = H.RingReader(w.path, stuck_ns=0)
    w._map.records["stamp"][0] = 0  # a writer died between reserve and publish
    assert reader.poll().shape == (0,)
    assert reader.poll().shape == (0,) and reader.lost == 1
    assert reader.poll()["seq"].tolist() == [2, 3]


def test_control_round_trip_between_agent_and_hook_side(tmp_path: Path) -> None:
    w = _writer(tmp_path)
    hook = w.control
    ctl = H.RingReader(w.path).control()
    modes = [hook.mode]
    ctl.set_mode("profile")
    modes.append(hook.mode)
    ctl.set_mode("monitor")
    assert [*modes, hook.mode] == ["monitor", "profile", "monitor"]
    ctl.pause(comm_id=5, seq=77)
    assert hook.pause_requested() and not ctl.paused() and hook.pause_target() == (5, 77)
    hook.set_paused(True, tid=42)
    assert ctl.paused()
    a = ctl.submit(H.BenchRequest(kind=H.BenchKind.SEND, size=1 << 20, repeat=2, comm_id=5, peer=3))
    b = ctl.submit(H.BenchRequest(kind=H.BenchKind.GEMM, size=1024))
    assert [i for i, _ in hook.pending()] == [a, b]
    assert hook.pending()[0][1].peer == 3
    assert ctl.result(a) is None
    hook.answer(a, H.BenchState.DONE, [1500, 1700])
    hook.answer(b, H.BenchState.UNSUPPORTED, [])
    res = ctl.result(a)
    assert res is not None and res.ok and res.durations_ns == (1500, 1700)
    res_b = ctl.result(b)
    assert res_b is not None and res_b.unsupported
    with pytest.raises(KeyError):
        ctl.result(999)
    ctl.resume()
    assert not hook.pause_requested()
    with pytest.raises(ValueError):
        ctl.submit(H.BenchRequest(kind=H.BenchKind.SEND, size=1, repeat=0))


def test_reader_refuses_foreign_files(tmp_path: Path) -> None:
    bad = tmp_path / "rank-0.ring"
    bad.write_bytes(b"\0" * 8192)
    with pytest.raises(ValueError):
        H.RingReader(bad)


def test_fields_are_read_after_their_stamp_was_seen(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A bulk copy may read a slot's stamp after its fields (the stores are ordered, a copy's
    loads need not be): the copy that saw a stamp must not be where the fields come from. Forged
    here: the first copy holds the new stamps with the fields as they were before the writer's
    stores; the records handed out carry the fields the hook wrote, and GPU times only where the
    first copy saw their flag."""
    w = _writer(tmp_path)
    reader = H.RingReader(w.path, gpu_wait_ns=0)
    r = _records(3)
    r["count"] = [11, 22, 33]
    r["flags"][2] = int(H.Flag.PROFILED)
    w.append(r)
    real = H.RingFile.records
    copies = []

    def records(self: H.RingFile, start: int, n: int) -> np.ndarray:
        got = real(self, start, n)
        if not copies:  # the first copy: stamps new, the rest of each slot still old
            stale = np.zeros_like(got)
            stale["stamp"] = got["stamp"]
            stale["flags"] = got["flags"]
            stale["return_ns"] = got["return_ns"]
            got = stale
            # the poller completes record 3 after that copy: times, then its flag
            slot = int(w._map.records["stamp"].argmax())
            w._map.records["gpu_start_ns"][slot] = 5
            w._map.records["gpu_end_ns"][slot] = 9
            w._map.records["flags"][slot] |= int(H.Flag.GPU_DONE)
        copies.append(n)
        return got

    monkeypatch.setattr(H.RingFile, "records", records)
    got = reader.poll()
    assert got["count"].tolist() == [11, 22, 33] and len(copies) == 2
    assert not int(got["flags"][2]) & H.Flag.GPU_DONE  # the first copy did not see it
