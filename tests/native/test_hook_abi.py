"""The Python mirror (greyhound.hookabi) against the C header, and its reader/writer/control."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from greyhound import hookabi as H

REPO = Path(__file__).resolve().parents[2]

_PROBE = r"""
#include <stddef.h>
#include <stdio.h>
#include "greyhound_ring.h"
#define P(s, f) printf("%s %s %zu\n", #s, #f, offsetof(struct s, f));
#define S(s) printf("%s sizeof %zu\n", #s, sizeof(struct s));
int main(void) {
@BODY@
  return 0;
}
"""


def _c_layout(tmp_path: Path) -> dict[tuple[str, str], int]:
    structs = {
        "gh_ring_header": H.HEADER_DTYPE,
        "gh_record": H.RECORD_DTYPE,
        "gh_comm_entry": H.COMM_DTYPE,
        "gh_control": H.CONTROL_DTYPE,
        "gh_bench_slot": H.BENCH_SLOT_DTYPE,
    }
    lines = []
    for s, dt in structs.items():
        lines.append(f"S({s})")
        lines += [f"P({s}, {f})" for f in dt.names or ()]
    src = tmp_path / "probe.c"
    src.write_text(_PROBE.replace("@BODY@", "\n".join(lines)))
    exe = tmp_path / "probe"
    subprocess.run(["cc", "-I", str(REPO / "native/include"), "-o", str(exe), str(src)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {(a, b): int(c) for a, b, c in (line.split() for line in out.splitlines())}


def test_numpy_layout_matches_the_c_header(tmp_path: Path) -> None:
    c = _c_layout(tmp_path)
    for s, dt in {"gh_ring_header": H.HEADER_DTYPE, "gh_record": H.RECORD_DTYPE,
                  "gh_comm_entry": H.COMM_DTYPE, "gh_control": H.CONTROL_DTYPE,
                  "gh_bench_slot": H.BENCH_SLOT_DTYPE}.items():
        assert c[(s, "sizeof")] == dt.itemsize, s
        for name in dt.names or ():
            assert c[(s, name)] == dt.fields[name][1], (s, name)


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
                        capacity=capacity)


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
    comms = reader.comms()
    assert comms.shape == (1,) and int(comms["calls_completed"][0]) == 150
    assert int(comms["last_seq_completed"][0]) == 100
    reader.close()
    w.close()


def test_p2p_counters_follow_the_hook_rules(tmp_path: Path) -> None:
    w = _writer(tmp_path)
    sends = _records(5, comm_id=9, op=H.Op.SEND)
    sends["peer"] = [2, 2, 3, 2, 3]
    recvs = _records(2, comm_id=9, op=H.Op.RECV)
    recvs["peer"] = 0
    w.append(np.concatenate((sends, recvs)))
    row = H.RingReader(w.path).comms()[0]
    peers = row["peer_ids"][: int(row["npeers"])].tolist()
    assert sorted(peers) == [0, 2, 3]
    by_peer = {p: (int(row["send_count"][i]), int(row["recv_count"][i]))
               for i, p in enumerate(peers)}
    assert by_peer == {2: (3, 0), 3: (2, 0), 0: (0, 2)}


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
    reader._map.records["flags"][slot] |= int(H.Flag.GPU_DONE)
    assert reader.poll()["seq"].tolist() == [2, 3]
    w.append(r[1:2])
    impatient = H.RingReader(w.path, gpu_wait_ns=0)  # gives up at once: the record comes as is
    got = impatient.poll()
    assert got.shape == (1,) and not int(got["flags"][0]) & H.Flag.GPU_DONE


def test_unfinished_slot_is_skipped_after_stuck_time(tmp_path: Path) -> None:
    w = _writer(tmp_path)
    w.append(_records(3))
    reader = H.RingReader(w.path, stuck_ns=0)
    reader._map.records["stamp"][0] = 0  # a writer died between reserve and publish
    assert reader.poll().shape == (0,)
    assert reader.poll().shape == (0,) and reader.lost == 1
    assert reader.poll()["seq"].tolist() == [2, 3]


def test_control_round_trip_between_agent_and_hook_side(tmp_path: Path) -> None:
    w = _writer(tmp_path)
    hook = w.control_view()
    ctl = H.RingReader(w.path).control()
    assert hook.mode == "monitor"
    ctl.set_mode("profile")
    assert hook.mode == "profile"
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
