"""A validation never harms the job, over the asynchronous fake that behaves as real NCCL and
PyTorch do where it matters (native/README.md):

* a benchmark send whose peer never posts does not wedge the job's communicator: the fake runs a
  communicator's operations in order on the device, as NCCL's shared device stream does, so a
  send left queued on a job communicator would hold every later training collective behind it;
  the hook sends on a benchmark communicator split from the job's and aborts it on failure;
* a pause never outlasts the job's collective timeout: the workload models PyTorch's watchdog
  (a collective not completed on the GPU within the process group's timeout of being issued
  takes the rank down), and the parked call was issued before the pause; the hook ends a pause
  at a quarter of the timeout the rank reports, whatever lease was asked;
* a targeted pause parks ranks whose DP communicator is used only inside groups (a coalesced
  reduce-scatter, as Megatron's), with a cut per communicator when the stages' DP communicators
  advance at different rates (one and two buckets an iteration).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from greyhound import hookabi as H
from greyhound.core.validation_plan import CommView, pause_plan
from greyhound.fakejob import FakeJob, FakeJobSpec
from tests.native.helpers import (
    bench_result,
    hook_lib,
    pause_then_die,
    wait_for,
    wait_rings,
    world_entry,
)


def _active(reader: H.RingReader) -> np.ndarray:
    comms = reader.comms()
    rows: np.ndarray = comms[comms["state"] == H.CommState.ACTIVE]
    return rows


def test_a_benchmark_send_whose_peer_never_posts_leaves_the_job_training(
        native_build: Path, tmp_path: Path) -> None:
    spec = FakeJobSpec(world_size=2, iters=300, compute_ms=5, compute_busy=0.0, job_id="lonely")
    shm = tmp_path / "shm"
    job = FakeJob(spec, workdir=tmp_path / "w", hook=hook_lib(native_build), shm_dir=shm,
                  env={"GREYHOUND_BENCH_TIMEOUT_MS": "400"})
    with job:
        readers = [H.RingReader(p) for p in wait_rings(shm, "lonely", 2)]
        ctls = [r.control() for r in readers]
        wait_for(lambda: int(world_entry(readers[0])["last_seq_entered"]) >= 3, 30, "job did not start")
        world = int(world_entry(readers[0])["comm_id"])
        target = max(int(world_entry(r)["last_seq_entered"]) for r in readers) + 2
        for c in ctls:
            c.pause(comm_id=world, seq=target)
        wait_for(lambda: all(c.paused() for c in ctls), 30, "ranks did not pause")
        # Both ranks make the benchmark communicator (a split is collective), then rank 0 sends
        # and rank 1 never receives: the peer's agent died, or its drain timed out.
        splits = [c.submit(H.BenchRequest(kind=H.BenchKind.SPLIT, size=0, comm_id=world))
                  for c in ctls]
        split_results = [bench_result(c, req) for c, req in zip(ctls, splits, strict=True)]
        t0 = time.monotonic()
        lonely = bench_result(ctls[0], ctls[0].submit(H.BenchRequest(
            kind=H.BenchKind.SEND, size=1 << 16, repeat=3, comm_id=world, peer=1)))
        took = time.monotonic() - t0
        # The parked thread is not held by it: the next request runs (on a fresh stream).
        gemm = bench_result(ctls[0], ctls[0].submit(H.BenchRequest(kind=H.BenchKind.GEMM, size=32)))
        before = [len(job.iterations(r)) for r in range(2)]
        for c in ctls:
            c.resume()
        # The job trains on: nothing of the benchmark holds its communicator's queue.
        codes = job.wait(60)
        after = [len(job.iterations(r)) for r in range(2)]
        blocks = [r.control_block() for r in readers]
    assert codes == [0, 0]
    assert after == [spec.iters] * 2 and min(a - b for a, b in zip(after, before, strict=True)) > 100
    assert [r.state for r in split_results] == [H.BenchState.DONE] * 2, split_results
    assert lonely.state == H.BenchState.FAILED and lonely.result == 600, lonely  # cudaErrorNotReady
    assert 0.35 < took < 10.0
    assert gemm.ok, gemm
    assert int(blocks[0]["bench_comms_made"]) == 1 and int(blocks[0]["bench_comms_aborted"]) == 1
    assert int(blocks[1]["bench_comms_aborted"]) == 0  # rank 1's was destroyed at the resume
    recs = readers[0].poll()
    # No benchmark operation on the job's communicator: its sends are the job's own (none here).
    assert not np.any(np.isin(recs["op"], H.P2P_OPS))


def test_a_pause_longer_than_the_jobs_collective_timeout_is_cut_and_the_job_lives(
        native_build: Path, tmp_path: Path) -> None:
    # A 3 s process-group timeout, reported to the hook; a validator that asks for a 10 s lease
    # and dies once the ranks parked: nobody resumes them.
    spec = FakeJobSpec(world_size=2, iters=250, compute_ms=5, compute_busy=0.0, job_id="pgto",
                       pg_timeout_s=3.0)
    shm = tmp_path / "shm"
    with FakeJob(spec, workdir=tmp_path / "w", hook=hook_lib(native_build), shm_dir=shm) as job:
        rings = wait_rings(shm, "pgto", 2)
        readers = [H.RingReader(p) for p in rings]  # the agent keeps reading what it mapped
        job.wait_iteration(0, 5, 30)
        t0 = time.monotonic()
        proc = pause_then_die(rings, lease_s=10.0)
        assert b"paused" in proc.stdout, proc.stderr
        codes = job.wait(60)
        took = time.monotonic() - t0
        blocks = [r.control_block() for r in readers]
    errs = (tmp_path / "w" / "rank0.err").read_text() + (tmp_path / "w" / "rank1.err").read_text()
    assert codes == [0, 0], errs  # the watchdog never fired
    assert "watchdog" not in errs
    for b in blocks:
        assert int(b["job_timeout_ms"]) == 3000 and int(b["pause_cap_ms"]) == 750
        assert int(b["pause_shortened"]) == 1 and int(b["lease_expired"]) == 0
    assert took < 10.0  # not held for the lease it asked


def _comm_views(readers: list[H.RingReader]) -> dict[int, list[CommView]]:
    """What the agents' status says: each rank's active communicators."""
    out: dict[int, list[CommView]] = {}
    for r in readers:
        out[r.header.rank] = [CommView(int(c["comm_id"]), int(c["rank"]), int(c["nranks"]),
                                       int(c["last_seq_entered"])) for c in _active(r)]
    return out


def test_a_pause_targeted_at_group_only_dp_communicators_of_stages_at_different_rates_parks_all(
        native_build: Path, tmp_path: Path) -> None:
    # DP2 x PP2: stage 0's DP communicator takes one reduce-scatter an iteration, stage 1's two,
    # each as one coalesced group; the pipeline sends and receives as batched groups too.
    spec = FakeJobSpec(world_size=4, pp=2, iters=400, compute_ms=4, compute_busy=0.0,
                       bytes=1 << 14, job_id="grouped", dp_grouped=True, dp_buckets=(1, 2))
    shm = tmp_path / "shm"
    with FakeJob(spec, workdir=tmp_path / "w", hook=hook_lib(native_build), shm_dir=shm) as job:
        readers = sorted((H.RingReader(p) for p in wait_rings(shm, "grouped", 4)),
                         key=lambda r: r.header.rank)
        ctls = [r.control() for r in readers]
        for r in range(4):
            job.wait_iteration(r, 10, 30)
        plan = pause_plan(_comm_views(readers))
        for r, c in enumerate(ctls):
            c.pause(comm_id=plan.comm_of_rank[r], seq=plan.seq_of_rank(r))
        wait_for(lambda: all(c.paused() for c in ctls), 20, "ranks did not all park")
        # A consistent cut: every rank's queued GPU work completes (its peers enqueued theirs).
        drains = [bench_result(c, c.submit(H.BenchRequest(kind=H.BenchKind.DRAIN, size=0)))
                  for c in ctls]
        stopped = [len(job.iterations(r)) for r in range(4)]
        for c in ctls:
            c.resume()
        codes = job.wait(60)
        recs = [r.poll() for r in readers]
    assert [d.state for d in drains] == [H.BenchState.DONE] * 4, drains
    assert codes == [0] * 4
    assert max(stopped) - min(stopped) <= 1, stopped  # the same iteration boundary
    dp = {r: plan.comm_of_rank[r] for r in range(4)}
    for r, rec in enumerate(recs):
        mine = rec[(rec["comm_id"] == np.uint64(H.unsigned64(dp[r])))
                   & np.isin(rec["op"], H.COLLECTIVE_OPS + H.P2P_OPS)]
        assert len(mine) > 0 and np.all(mine["flags"] & H.Flag.IN_GROUP)  # only ever in groups
        assert np.all(mine["op"] == H.Op.REDUCESCATTER)
    assert plan.seq_of_rank(1) > plan.seq_of_rank(0)  # stage 1 advances twice as fast
