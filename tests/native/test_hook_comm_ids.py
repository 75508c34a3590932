"""One communicator, one id on every rank, whatever made it: NCCL 2.23+'s ncclCommInitRankScalable
(PyTorch's way for large worlds: several unique ids, the same list on every rank), ncclCommSplit
of such a communicator, and NCCL 2.27+'s ncclCommShrink (called by the ranks that stay; the
excluded ones, dead or leaving, never call it). The hang watch and the validator match a
communicator's members by this id: a per-process id would leave each rank alone in its own."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from greyhound import hookabi as H
from greyhound.core.job_hangs import COUNTER_FIELDS, JobHangMonitor
from greyhound.fakejob import FakeJob, FakeJobSpec
from services.agent.collector import Collector
from tests.native.helpers import hook_lib, wait_for


def _run(native_build: Path, tmp_path: Path, spec: FakeJobSpec, env: dict[str, str]
         ) -> list[np.ndarray]:
    """Each rank's comm table once the job is over (the rings kept for the read)."""
    shm = tmp_path / "shm"
    with FakeJob(spec, workdir=tmp_path / "w", hook=hook_lib(native_build), shm_dir=shm,
                 env={"GREYHOUND_RING_KEEP": "1", **env}) as job:
        assert job.wait(60) == [0] * spec.world_size
    rings = H.list_rings(shm, spec.job_id)
    assert len(rings) == spec.world_size
    tables = []
    for p in rings:
        r = H.RingReader(p)
        tables.append(r.comms())
        r.close()
    return tables


def _ids(table: np.ndarray, parent: int) -> dict[int, int]:
    """comm_id -> nranks of the communicators with this parent."""
    rows = table[table["parent_id"] == parent]
    return {int(c["comm_id"]): int(c["nranks"]) for c in rows}


def test_scalable_init_and_its_splits_have_one_id_on_every_rank(native_build: Path,
                                                                 tmp_path: Path) -> None:
    spec = FakeJobSpec(world_size=4, iters=30, compute_ms=2, compute_busy=0.0, tp=2,
                       job_id="scalable", verbose=False)
    tables = _run(native_build, tmp_path, spec, {"GH_INIT_IDS": "2"})
    worlds = [_ids(t, 0) for t in tables]
    assert all(len(w) == 1 for w in worlds), worlds  # no per-process id for the world
    (world,) = {next(iter(w)) for w in worlds}  # one id on every rank
    assert worlds[0][world] == 4
    children = [_ids(t, world) for t in tables]
    assert all(len(c) == 2 and set(c.values()) == {2} for c in children)  # its TP and DP comms
    # Megatron's layout (TP innermost): TP {0,1} {2,3}, DP {0,2} {1,3}; members share the id
    assert set(children[0]) & set(children[1]) and set(children[2]) & set(children[3])
    assert set(children[0]) & set(children[2]) and set(children[1]) & set(children[3])
    assert len({cid for c in children for cid in c}) == 4


def test_a_shrunk_communicator_has_one_id_across_the_ranks_that_stay(native_build: Path,
                                                                     tmp_path: Path) -> None:
    spec = FakeJobSpec(world_size=3, iters=30, compute_ms=2, compute_busy=0.0, job_id="shrink",
                       verbose=False)
    tables = _run(native_build, tmp_path, spec, {"GH_INIT_IDS": "3", "GH_SHRINK_LAST": "1"})
    (world,) = {int(c["comm_id"]) for t in tables for c in t[t["parent_id"] == 0]}
    shrunk = [t[t["parent_id"] == world] for t in tables]
    assert len(shrunk[2]) == 0  # the rank that left never called it
    ids = {int(s["comm_id"][0]) for s in shrunk[:2]}
    assert len(ids) == 1 and all(len(s) == 1 for s in shrunk[:2])
    for rank, s in enumerate(shrunk[:2]):  # the ranks that stay, renumbered without the gap
        assert (int(s["rank"][0]), int(s["nranks"][0])) == (rank, 2)
        assert int(s["calls_entered"][0]) >= spec.iters  # the job trained on it


def test_the_hang_watch_sees_every_member_of_a_scalable_communicator(native_build: Path,
                                                                     tmp_path: Path) -> None:
    """The agent's counter rows, as the tracker's hang watch groups them: a rank whose GPU never
    finishes one all-reduce, and the watch names the communicator with both members in it."""
    spec = FakeJobSpec(world_size=2, iters=400, compute_ms=5, compute_busy=0.0, job_id="sclhang",
                       verbose=False)
    shm = tmp_path / "shm"
    with FakeJob(spec, workdir=tmp_path / "w", hook=hook_lib(native_build), shm_dir=shm,
                 env={"GH_INIT_IDS": "2"}) as job:
        col = Collector(shm, "sclhang")

        def both_rings() -> bool:
            col.scan()
            return len(col.streams) == 2

        wait_for(both_rings, 30, "rings")
        readers = [s.reader for s in col.streams.values()]
        wait_for(lambda: all(len(r.comms()) and int(r.comms()["gpu_calls_done"][0]) > 5
                             for r in readers), 30, "marks")
        hung = max(int(r.comms()["last_seq_entered"][0]) for r in readers) + 10
        job.faults.set(f"never_complete 1 {hung - 1}")
        wait_for(lambda: all(int(r.comms()["gpu_pending_seq"][0]) >= hung for r in readers), 30,
                 "no pending call")
        time.sleep(1.2)
        rows = col.counters(time.monotonic_ns())
        mon = JobHangMonitor(floor_s=1.0)
        mon.observe_counters(time.time(), {f: getattr(rows, f) for f in COUNTER_FIELDS})
        found = mon.check(time.time())
        col.close()
        job.kill()
    assert len(found) == 1 and found[0].members == (0, 1), found
