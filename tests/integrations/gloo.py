"""Local gloo jobs for the integration tests: N processes of one worker module on loopback, each
writing its JSON result; and the worker side's arguments and rendezvous."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_ranks(module: str, world: int, tmp: Path, *, timeout_s: float) -> list[dict[str, Any]]:
    """Run ``python -m module`` as ``world`` gloo processes; every rank's JSON, or an assertion
    with the failing rank's log. ``timeout_s`` bounds the whole job."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               PYTHONWARNINGS="ignore")
    procs = [subprocess.Popen(
        [sys.executable, "-m", module, "--rank", str(r), "--world", str(world), "--store",
         str(tmp / "store"), "--out", str(tmp / f"rank{r}.json")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(world)]
    logs = []
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{logs[r][-4000:]}"
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


def worker_args() -> argparse.Namespace:
    """A worker's arguments (as :func:`run_ranks` passes them), its process group initialised."""
    import torch
    import torch.distributed as dist

    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--store", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{a.store}", rank=a.rank, world_size=a.world)
    return a
