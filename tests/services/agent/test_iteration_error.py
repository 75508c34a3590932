"""The agent's per-rank iteration times against the workload's own, on the fake NCCL.

Ground truth: the workload prints, per iteration, its host's monotonic start (t0), the end of
its launches, where it enters the iteration's one stream synchronisation (t1), the return from it
(t2), and the GPU's end of the iteration (gd, from CUDA events). Like a PyTorch loop on a GPU, the
host launches asynchronously and waits once per iteration, so the agent, which sees only the
host's NCCL calls, measures host times whose period follows the GPU's. It measures an op against
the same op one period earlier, so its iteration boundary sits at one phase of the loop (the
launch of the first collective, just before t1): per iteration, the truth is the gap between
consecutive markers of the phase the agent's boundaries are nearest to, matched by time. (Against
another phase, e.g. t0, single iterations differ by how long each waited; the mean over the same
iterations is printed for reference.) The issue's target: error <= 1% (paper: <= 1.2%).

With pipeline send/recv the agent's boundary op sits at none of the three markers, so single
iterations cannot be matched to a marker phase; there the level the detector works on, the mean
over 30 consecutive iterations, is compared with the loop's own period over the same span, and
with the GPU's period over it (the host's times follow the GPU's).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from greyhound.fakejob import FakeJob, FakeJobSpec, native_build_dir
from services.agent.collector import Collector, RankIteration

ITERS = 90


def _run(tmp: Path, *, tp: int, pp: int) -> dict[int, tuple[list[RankIteration], int]]:
    """Run the job while draining the rings; per rank its iterations and wall-minus-mono offset."""
    shm = tmp / "shm"
    spec = FakeJobSpec(world_size=4, iters=ITERS, compute_ms=25.0, tp=tp, pp=pp,
                       job_id=f"iterr-tp{tp}-pp{pp}", compute_busy=0.1, verbose=True)
    col = Collector(shm, spec.job_id)
    got: list[RankIteration] = []
    offsets: dict[int, int] = {}  # read while the rings exist: the hook removes them at exit
    with FakeJob(spec, workdir=tmp / "job", hook=native_build_dir() / "libgreyhound_hook.so",
                 shm_dir=shm) as job:
        deadline = time.monotonic() + 25.0
        while job.running() and time.monotonic() < deadline:
            col.scan()
            got += col.drain()
            offsets.update({s.rank: s.wall_offset_ns() for s in col.streams.values()})
            time.sleep(0.05)
        assert not job.running(), "fake job did not finish in time"
        col.scan()
        got += col.drain()
        truth = {r: job.iterations(r) for r in range(spec.world_size)}
    out: dict[int, tuple[list[RankIteration], int]] = {}
    for rank in range(spec.world_size):
        out[rank] = ([i for i in got if i.rank == rank], offsets[rank])
        assert len(truth[rank]) == ITERS
    _TRUTH.clear()
    _TRUTH.update({r: np.array([[t.start_ns, t.compute_end_ns, t.end_ns, t.gpu_done_ns] for t in its],
                               dtype=np.int64) for r, its in truth.items()})
    return out


_TRUTH: dict[int, np.ndarray] = {}


def _errors(rank: int, its: list[RankIteration], offset_ns: int) -> tuple[np.ndarray, float]:
    """Per-iteration relative errors at the agent's phase, and the phase-free error of the mean."""
    marks = _TRUTH[rank]
    ends = np.array([it.end_wall_ns - offset_ns for it in its], dtype=np.int64)
    dur = np.array([it.duration_s for it in its])
    # The phase (host t0, t1 or t2) whose markers the agent's boundaries sit on.
    gaps = [np.median(np.min(np.abs(ends[:, None] - marks[None, :, p]), axis=1)) for p in range(3)]
    phase = marks[:, int(np.argmin(gaps))]
    k = np.argmin(np.abs(ends[:, None] - phase[None, :]), axis=1)
    ok = k >= 1
    truth = (phase[k[ok]] - phase[k[ok] - 1]) / 1e9
    errs = np.abs(dur[ok] - truth) / truth
    # The loop's own period from its start markers (printing between iterations included), over
    # the same iterations.
    own = float(np.mean(marks[k[ok], 0] - marks[k[ok] - 1, 0])) / 1e9
    return errs, abs(float(dur[ok].mean()) - own) / own


WINDOW = 30


def _window_errors(rank: int, its: list[RankIteration], offset_ns: int) -> tuple[np.ndarray, np.ndarray]:
    """Relative error of the mean of WINDOW consecutive iterations against the loop's period
    (host start markers) and against the GPU's (its iteration ends) over the span those
    iterations cover."""
    starts = _TRUTH[rank][:, 0]
    gpu_done = _TRUTH[rank][:, 3]
    ends = np.array([it.end_wall_ns - offset_ns for it in its], dtype=np.int64)
    dur = np.array([it.duration_s for it in its])
    errs, gpu_errs = [], []
    for i in range(WINDOW, len(its)):
        if its[i].iteration - its[i - WINDOW].iteration != WINDOW:
            continue  # a gap (re-learned period): not one span
        span_s = (ends[i] - ends[i - WINDOW]) / 1e9
        covered = (starts > ends[i - WINDOW]) & (starts <= ends[i])
        if covered.sum() != WINDOW:
            continue  # the span runs past the first or last marker
        k = np.flatnonzero(covered)
        loop = float(starts[k[-1]] - starts[k[0] - 1]) / 1e9 / WINDOW if k[0] > 0 else None
        if loop is None:
            continue
        errs.append(abs(float(dur[i - WINDOW + 1: i + 1].mean()) - loop) / loop)
        assert abs(span_s - float(dur[i - WINDOW + 1: i + 1].sum())) < 1e-6
        # The GPU ended iterations k[0]-1 .. k[-1]-1 within the span (each host start follows
        # the previous iteration's synchronisation, which waited for the GPU's end).
        if k[0] >= 2 and gpu_done[k[0] - 2] > 0 and gpu_done[k[-1] - 1] > 0:
            gpu = float(gpu_done[k[-1] - 1] - gpu_done[k[0] - 2]) / 1e9 / WINDOW
            gpu_errs.append(abs(float(dur[i - WINDOW + 1: i + 1].mean()) - gpu) / gpu)
    return np.array(errs), np.array(gpu_errs)


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 2)])
def test_iteration_time_error_within_one_percent(tmp_path: Path, tp: int, pp: int) -> None:
    runs = _run(tmp_path, tp=tp, pp=pp)
    per_it, windows, gpu_windows = [], [], []
    for rank, (its, offset) in runs.items():
        assert len(its) >= ITERS - 20, f"rank {rank}: only {len(its)} iterations found"
        errs, mean_err = _errors(rank, its, offset)
        per_it.append(errs)
        host_w, gpu_w = _window_errors(rank, its, offset)
        windows.append(host_w)
        gpu_windows.append(gpu_w)
        print(f"rank {rank}: mean vs t0-period over the same iterations {mean_err:.2%}")
    w = np.concatenate(windows)
    assert w.size >= 60
    print(f"tp={tp} pp={pp}: {w.size} windows of {WINDOW}, median error {np.median(w):.4%}, "
          f"p95 {np.percentile(w, 95):.4%}")
    assert float(np.median(w)) <= 0.01 and float(np.percentile(w, 95)) <= 0.01
    g = np.concatenate(gpu_windows)
    assert g.size >= 60
    print(f"tp={tp} pp={pp}: against the GPU's period, median error {np.median(g):.4%}, "
          f"p95 {np.percentile(g, 95):.4%}")
    assert float(np.median(g)) <= 0.01 and float(np.percentile(g, 95)) <= 0.01
    if pp == 1:  # single iterations too: the boundary sits on a marker phase
        errs = np.concatenate(per_it)
        med, p95 = float(np.median(errs)), float(np.percentile(errs, 95))
        print(f"tp={tp} pp={pp}: {errs.size} iterations, median error {med:.4%}, p95 {p95:.4%}")
        assert med <= 0.01 and p95 <= 0.01
