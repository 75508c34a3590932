"""Comm rows are read whole or not at all: the hook updates a row's host fields (the thread inside
a call), its GPU fields (its poller) and its lifecycle fields (any other thread: an abort from a
watchdog, an init taking the slot) under three seqlock words, and the reader takes a row only
between two reads of them that find them all even and unchanged (layouts 5 and 6)."""

from __future__ import annotations

import threading
from pathlib import Path

from greyhound import hookabi as H
from greyhound.hookabi.mapping import RingMapping


def _ring(tmp_path: Path) -> H.RingWriter:
    return H.RingWriter(H.ring_path(tmp_path, "seq", 0), job="seq", rank=0, host="h", pid=0,
                        device=0, capacity=64, comms=[H.CommRow(7, 0, 2), H.CommRow(9, 0, 2)])


def test_a_row_mid_update_is_left_out_and_counted(tmp_path: Path) -> None:
    w = _ring(tmp_path)
    m = RingMapping(w.path)
    m.comm_table[1]["host_ver"] = 3  # the writer is inside row 1
    reader = H.RingReader(w.path)
    assert [int(c) for c in reader.comms()["comm_id"]] == [7]
    assert reader.torn == 1
    m.comm_table[1]["host_ver"] = 4
    m.comm_table[0]["gpu_ver"] = 1  # the poller is inside row 0
    assert [int(c) for c in reader.comms()["comm_id"]] == [9] and reader.torn == 2
    m.comm_table[0]["gpu_ver"] = 2
    m.comm_table[1]["life_ver"] = 7  # another thread (an abort) is inside row 1
    assert [int(c) for c in reader.comms()["comm_id"]] == [7] and reader.torn == 3
    reader.close()
    w.close()


def test_a_writer_racing_the_reader_never_shows_a_torn_row(tmp_path: Path) -> None:
    """A writer keeps three counters of a row equal under its seqlock, the way the hook's enter
    and exit do; every row the reader hands out has them equal (preads drop the GIL, so the
    writer runs in the middle of the reader's copies)."""
    w = _ring(tmp_path)
    m = RingMapping(w.path)
    row = m.comm_table[0:1]
    stop = threading.Event()

    def write() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            v = int(row["host_ver"][0])
            row["host_ver"] = v + 1
            row["calls_entered"] = n
            row["last_seq_entered"] = n
            row["calls_completed"] = n
            row["host_ver"] = v + 2

    t = threading.Thread(target=write)
    t.start()
    reader = H.RingReader(w.path)
    seen = 0
    try:
        for _ in range(3000):
            for r in reader.comms(tries=64):
                if int(r["comm_id"]) == 7:
                    assert int(r["calls_entered"]) == int(r["last_seq_entered"]) == int(r["calls_completed"])
                    seen += 1
    finally:
        stop.set()
        t.join()
    assert seen > 100  # most reads get through
    reader.close()
    w.close()
