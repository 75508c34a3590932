#!/usr/bin/env python3
"""On a real NVIDIA GPU with PyTorch: the hook's pause and benchmarks never harm the job.

One single-rank PyTorch training process (NCCL refuses two ranks on one GPU), the hook
preloaded, whose every iteration is a matmul, a coalesced reduce-scatter
(``_coalescing_manager``: NCCL calls only inside ncclGroupStart/End, as Megatron's DP step) and a
self ``batch_isend_irecv``; its process group's timeout is reported to the hook through
``greyhound.integrations.pg_timeout``. This script plays the node agent on the rank's ring and
checks, in turn:

1. groups: the communicator's calls are all inside groups, their completion marks clear after
   the outermost GroupEnd (nothing left pending on the GPU), and a pause targeted at that
   group-only communicator parks the rank (after the group that reaches it) and drains;
2. lonely-send: a benchmark send with no receiver (a self send on the single-rank benchmark
   communicator split from the job's) fails within the benchmark timeout, the benchmark
   communicator is aborted, and after the resume training goes on (on the job's communicator,
   which never held the send);
3. timeout-cap: with a 20 s process-group timeout reported, a pause asked for 25 s (and never
   resumed, as by a validator that died) ends at a quarter of the timeout, and the job lives
   (TORCH_NCCL_ASYNC_ERROR_HANDLING=3: a watchdog timeout would take it down); the validator's
   budget for such a job is a quarter of it too.

Results: ``gpu_check_pause.json`` under ``--out`` (default ``$OUT``, else ./gpu-check-pause), and
last a ``RESULT {json}`` line; exit status 0 when every check passed. The checks run on any rank
that writes a hook ring: the CPU tests run them on the fake workload (tests/native).

Not run in this project's CI (no GPU): written for the GPU machine, with its CPU-checkable parts
tested.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402  (after the checkout is on the path)

from greyhound import hookabi as H  # noqa: E402

JOB = "gpucheck-pause"
CUDA_NOT_READY = 600


class Rank(Protocol):
    """A training process the checks watch: its ring, its progress, its life."""

    ring: Path

    def iterations(self) -> int: ...

    def alive(self) -> bool: ...


def _wait(cond: Callable[[], bool], timeout_s: float, step_s: float = 0.002) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step_s)
    return cond()


def _result(ctl: H.Control, req: int, timeout_s: float) -> H.BenchResult | None:
    out: list[H.BenchResult] = []

    def done() -> bool:
        res = ctl.result(req)
        if res is not None:
            out.append(res)
        return bool(out)

    _wait(done, timeout_s)
    return out[0] if out else None


def group_comm(reader: H.RingReader) -> Any:
    """The job's first active communicator (the default process group's), a comm-table row."""
    comms = reader.comms()
    rows = comms[(comms["state"] == H.CommState.ACTIVE) & (comms["parent_id"] == 0)]
    if len(rows) == 0:
        raise RuntimeError("the rank has no active communicator")
    return rows[0]


def _marks_clear(reader: H.RingReader) -> bool:
    """Every call enqueued on the communicator is done on the GPU, none pending."""
    e = group_comm(reader)
    return (int(e["gpu_marks"]) == 1 and int(e["calls_entered"]) > 0
            and int(e["gpu_calls_done"]) == int(e["calls_entered"]) and int(e["gpu_pending_ns"]) == 0)


def _progress(rank: Rank, after: int, want: int, timeout_s: float) -> int:
    """Iterations done since ``after`` once ``want`` more are done or the time is up."""
    _wait(lambda: rank.iterations() - after >= want or not rank.alive(), timeout_s, 0.05)
    return rank.iterations() - after


def _pause(reader: H.RingReader, ctl: H.Control, lease_s: float) -> tuple[int, int, bool]:
    """Pause targeted at the group-only communicator, two collectives ahead; (comm, seq,
    parked within 10 s)."""
    c = group_comm(reader)
    comm, seq = int(c["comm_id"]), int(c["last_seq_entered"]) + 2
    ctl.pause(comm_id=comm, seq=seq, lease_s=lease_s)
    return comm, seq, _wait(ctl.paused, 10.0)


def check_groups(rank: Rank, reader: H.RingReader) -> dict[str, Any]:
    ctl = reader.control()
    c = group_comm(reader)
    # Marks clear after the outermost GroupEnd: at some moment every call the host enqueued on
    # the communicator is done on the GPU and nothing is pending.
    cleared = _wait(lambda: _marks_clear(reader), 20.0, 0.0005)
    recs = reader.poll()
    data = recs[(recs["comm_id"] == c["comm_id"])
                & np.isin(recs["op"], H.COLLECTIVE_OPS + H.P2P_OPS)]
    only_in_groups = bool(len(data)) and bool((data["flags"] & H.Flag.IN_GROUP).all())
    before = rank.iterations()
    comm, seq, parked = _pause(reader, ctl, lease_s=10.0)
    entered = int(group_comm(reader)["last_seq_entered"]) if parked else 0
    drain = _result(ctl, ctl.submit(H.BenchRequest(kind=H.BenchKind.DRAIN, size=0)), 10.0) \
        if parked else None
    ctl.resume()
    unparked = _wait(lambda: not ctl.paused(), 10.0)
    went_on = _progress(rank, before, 5, 30.0)
    ok = (cleared and only_in_groups and parked and entered >= seq and drain is not None
          and drain.ok and unparked and went_on >= 5 and rank.alive())
    return {"ok": ok, "marks_cleared_after_group_end": cleared, "calls_only_in_groups":
            only_in_groups, "data_calls_seen": len(data), "pause_target_seq": seq,
            "parked": parked, "seq_entered_when_parked": entered,
            "drain_state": drain.state.name if drain else None,
            "drain_ms": round(drain.drain_ns / 1e6, 3) if drain else None,
            "iterations_after_resume": went_on, "comm_id": comm}


def check_lonely_send(rank: Rank, reader: H.RingReader, *, bench_timeout_s: float
                      ) -> dict[str, Any]:
    ctl = reader.control()
    aborted0 = int(reader.control_block()["bench_comms_aborted"])
    comm, _, parked = _pause(reader, ctl, lease_s=max(10.0, 3 * bench_timeout_s))
    split = send = None
    took = 0.0
    if parked:
        split = _result(ctl, ctl.submit(H.BenchRequest(kind=H.BenchKind.SPLIT, size=0,
                                                       comm_id=comm)), 30.0)
        t0 = time.monotonic()
        send = _result(ctl, ctl.submit(H.BenchRequest(kind=H.BenchKind.SEND, size=1 << 20,
                                                      repeat=3, comm_id=comm, peer=0)),
                       bench_timeout_s + 20.0)
        took = time.monotonic() - t0
    aborted = int(reader.control_block()["bench_comms_aborted"]) - aborted0
    before = rank.iterations()
    ctl.resume()
    _wait(lambda: not ctl.paused(), 10.0)
    went_on = _progress(rank, before, 10, 60.0)
    ok = (parked and split is not None and split.ok and send is not None
          and send.state == H.BenchState.FAILED and took < bench_timeout_s + 10.0
          and aborted == 1 and went_on >= 10 and rank.alive())
    return {"ok": ok, "parked": parked, "split_state": split.state.name if split else None,
            "send_state": send.state.name if send else None,
            "send_result": send.result if send else None, "send_failed_after_s": round(took, 3),
            "bench_comms_aborted": aborted, "iterations_after_resume": went_on,
            "job_alive": rank.alive()}


def _validator_budget(reported_s: float) -> float | None:
    """What the validator would hold this job for; None where its packages are not installed
    (a bare PyTorch image)."""
    try:
        from services.common.bus.contract import RankStatus
        from services.validator.hold import pause_budget
        from services.validator.settings import ValidatorSettings
    except ImportError:
        return None
    budget, _ = pause_budget(ValidatorSettings(), [RankStatus(
        rank=0, host="h", device=0, mode="monitor", paused=False, comms=[],
        job_timeout_s=reported_s or None)])
    return budget


def check_timeout_cap(rank: Rank, reader: H.RingReader, *, pg_timeout_s: float, pause_s: float
                      ) -> dict[str, Any]:
    ctl = reader.control()
    block = reader.control_block()
    reported = int(block["job_timeout_ms"]) / 1000
    shortened0 = int(block["pause_shortened"])
    t0 = time.monotonic()
    _, _, parked = _pause(reader, ctl, lease_s=pause_s)  # never resumed: a validator that died
    held = 0.0
    if parked:
        parked_at = time.monotonic()
        _wait(lambda: not ctl.paused(), pause_s + 10.0, 0.01)
        held = time.monotonic() - parked_at
    block = reader.control_block()
    before = rank.iterations()
    went_on = _progress(rank, before, 10, 60.0)
    cap = pg_timeout_s / H.PAUSE_TIMEOUT_SHARE
    budget = _validator_budget(reported)
    ok = (parked and abs(reported - pg_timeout_s) < 1e-3 and held < pause_s - 1.0
          and held >= cap - 0.5 and int(block["pause_shortened"]) == shortened0 + 1
          and (budget is None or budget <= cap + 1e-9) and went_on >= 10 and rank.alive())
    return {"ok": ok, "pg_timeout_reported_s": reported, "pause_asked_s": pause_s,
            "parked": parked, "held_s": round(held, 3), "cap_s": cap,
            "pause_cap_ms": int(block["pause_cap_ms"]), "pause_shortened":
            int(block["pause_shortened"]) - shortened0, "validator_budget_s": budget,
            "iterations_after": went_on,
            "job_alive": rank.alive(), "waited_s": round(time.monotonic() - t0, 3)}


def run_checks(rank: Rank, *, pg_timeout_s: float, pause_s: float, bench_timeout_s: float
               ) -> dict[str, Any]:
    """The three checks, in order, on one rank; each one's findings and ``ok``."""
    if not _wait(rank.ring.exists, 120.0, 0.05):
        return {"ok": False, "error": f"no ring at {rank.ring}"}
    reader = H.RingReader(rank.ring)
    try:
        _wait(lambda: rank.iterations() >= 5 or not rank.alive(), 120.0, 0.05)
        out: dict[str, Any] = {"groups": check_groups(rank, reader)}
        out["lonely_send"] = check_lonely_send(rank, reader, bench_timeout_s=bench_timeout_s)
        out["timeout_cap"] = check_timeout_cap(rank, reader, pg_timeout_s=pg_timeout_s,
                                               pause_s=pause_s)
    finally:
        reader.close()
    out["ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    return out


# ---- the PyTorch training process ------------------------------------------------------------

def child(pg_timeout_s: float, stop: Path) -> int:
    """The training loop (``--child``): needs torch with CUDA and NCCL."""
    torch = importlib.import_module("torch")
    dist = importlib.import_module("torch.distributed")
    from greyhound.integrations.pg_timeout import process_group_timeout, report_pg_timeout

    torch.cuda.set_device(0)
    store = tempfile.mkdtemp(prefix="gh-store-")
    dist.init_process_group("nccl", init_method=f"file://{store}/store", rank=0, world_size=1,
                            timeout=timedelta(seconds=pg_timeout_s))
    try:
        timeout = process_group_timeout()
    except LookupError as exc:
        print(f"pg timeout not readable ({exc}); reporting the one passed", file=sys.stderr)
        timeout = timedelta(seconds=pg_timeout_s)
    report_pg_timeout(timeout)
    c10d = dist.distributed_c10d
    x = torch.randn(2048, 2048, device="cuda")
    grads = [torch.randn(1 << 20, device="cuda"), torch.randn(1 << 19, device="cuda")]
    shards = [torch.empty_like(g) for g in grads]
    send, recv = torch.randn(1 << 16, device="cuda"), torch.empty(1 << 16, device="cuda")
    it = 0
    parent = os.getppid()
    while not stop.exists() and os.getppid() == parent:  # never outlive the checks
        y = x @ x  # the step's compute
        with c10d._coalescing_manager(device=torch.device("cuda", 0), async_ops=True) as cm:
            for g, s in zip(grads, shards, strict=True):  # Megatron's coalesced DP reduce-scatter
                dist.reduce_scatter_tensor(s, g, async_op=True)
        cm.wait()
        for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, 0),
                                           dist.P2POp(dist.irecv, recv, 0)]):
            req.wait()
        float(y[0, 0])  # the loss read: one synchronisation a step
        it += 1
        print(f"it={it}", flush=True)
    dist.destroy_process_group()
    return 0


class TorchRank:
    """The PyTorch child of this script, under the hook."""

    def __init__(self, out: Path, hook: Path, *, pg_timeout_s: float, bench_timeout_s: float
                 ) -> None:
        self.out = out
        self.stop = out / "stop"
        self.log = out / "child.out"
        self.ring = H.ring_path(out / "shm", JOB, 0)
        env = dict(os.environ, LD_PRELOAD=str(hook), GREYHOUND_SHM_DIR=str(out / "shm"),
                   GREYHOUND_JOB_ID=JOB, RANK="0", WORLD_SIZE="1",
                   GREYHOUND_BENCH_TIMEOUT_MS=str(round(bench_timeout_s * 1000)),
                   TORCH_NCCL_ASYNC_ERROR_HANDLING="3", PYTHONPATH=str(REPO))
        self.stop.unlink(missing_ok=True)
        with self.log.open("w") as log, (out / "child.err").open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, "--child", "--pg-timeout", str(pg_timeout_s),
                 "--out", str(out)], env=env, stdout=log, stderr=err)

    def iterations(self) -> int:
        lines = [x for x in self.log.read_text().splitlines() if x.startswith("it=")]
        return int(lines[-1][3:]) if lines else 0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def finish(self) -> int | None:
        self.stop.touch()
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-check-pause"),
                   help="folder for the results (default: $OUT, else ./gpu-check-pause)")
    p.add_argument("--hook", type=Path, default=REPO / "native" / "build" / "libgreyhound_hook.so")
    p.add_argument("--pg-timeout", type=float, default=20.0,
                   help="the process group's timeout, seconds (reported to the hook)")
    p.add_argument("--pause", type=float, default=25.0,
                   help="the lease the never-resumed pause asks for, seconds")
    p.add_argument("--bench-timeout", type=float, default=3.0,
                   help="the hook's benchmark timeout (GREYHOUND_BENCH_TIMEOUT_MS), seconds")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.pg_timeout <= 0 or args.pause <= 0 or args.bench_timeout <= 0:
        p.error("--pg-timeout, --pause and --bench-timeout must be > 0")
    return args


def _torch_cuda() -> str | None:
    """Why this machine cannot run the checks, or None."""
    probe = ("import torch, torch.distributed as d; "
             "assert torch.cuda.is_available(), 'no CUDA device'; "
             "assert d.is_nccl_available(), 'no NCCL in this PyTorch'")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    if p.returncode == 0:
        return None
    last = (p.stderr.strip().splitlines() or ["unknown"])[-1]
    return f"PyTorch with CUDA and NCCL is not usable here: {last}"


def _terminated(signum: int, _frame: object) -> None:
    """A SIGTERM (the step's timeout) ends the checks through their cleanup: the child stopped."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args.pg_timeout, args.out / "stop")
    signal.signal(signal.SIGTERM, _terminated)
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"check": "gpu_check_pause", "pg_timeout_s": args.pg_timeout,
                              "pause_s": args.pause, "bench_timeout_s": args.bench_timeout}
    why = _torch_cuda() or (None if args.hook.exists() else f"no hook library at {args.hook}")
    if why is not None:
        result.update(ok=False, error=why)
    else:
        rank = TorchRank(args.out, args.hook, pg_timeout_s=args.pg_timeout,
                         bench_timeout_s=args.bench_timeout)
        try:
            result.update(run_checks(rank, pg_timeout_s=args.pg_timeout, pause_s=args.pause,
                                     bench_timeout_s=args.bench_timeout))
        finally:
            result["child_exit"] = rank.finish()
        result["ok"] = bool(result.get("ok")) and result["child_exit"] == 0
    (args.out / "gpu_check_pause.json").write_text(json.dumps(result, indent=2) + "\n")
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
