#!/usr/bin/env python3
"""One single-rank PyTorch NCCL training run for scripts/gpu_check.sh (not for direct use).

GH_MODE: none (no hook), monitor, or profile (switched on through the control block after the
ring appears). In profile mode it also drives one GEMM benchmark through the pause path from a
separate agent process, as the node agent would. Prints one JSON line with its measurements.
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Imported by name: torch exists only on the GPU machine, and mypy runs where it does not.
torch = importlib.import_module("torch")
dist = importlib.import_module("torch.distributed")

_AGENT = r"""
import sys, time
from pathlib import Path
from greyhound import hookabi as H
ctl = H.Control(Path(sys.argv[1]))
ctl.pause()
deadline = time.monotonic() + 60
while not ctl.paused():
    if time.monotonic() > deadline:
        ctl.resume(); print("never paused"); sys.exit(1)
    time.sleep(0.001)
rid = ctl.submit(H.BenchRequest(kind=H.BenchKind.GEMM, size=2048, repeat=5))
res = None
while res is None and time.monotonic() < deadline:
    res = ctl.result(rid)
    time.sleep(0.001)
ctl.resume()
print(res.state.name if res else "timeout", *(res.durations_ns if res else ()))
sys.exit(0 if res is not None and res.ok else 1)
"""


def main() -> int:
    mode = os.environ.get("GH_MODE", "none")
    steps = int(os.environ.get("GH_STEPS", "300"))
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(),
                                torch.nn.Linear(2048, 1024)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 1024, device=dev)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()

    for _ in range(20):  # warm-up: NCCL init, ring creation, autotuning
        step()
    torch.cuda.synchronize()
    ring = None
    reader = None
    if mode != "none":
        from greyhound import hookabi as H

        ring = H.ring_path(Path(os.environ["GREYHOUND_SHM_DIR"]),
                           os.environ["GREYHOUND_JOB_ID"], 0)
        if not ring.exists():
            print(f"gpu_check: the hook made no ring at {ring}", file=sys.stderr)
            return 1
        reader = H.RingReader(ring, gpu_wait_ns=3_000_000_000)
        reader.poll()
        if mode == "profile":
            reader.control().set_mode("profile")
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    out: dict[str, object] = {"mode": mode, "ms_per_step": round(ms, 4),
                              "device": torch.cuda.get_device_name(0)}
    gemm_ok, gemm_ns = False, []
    if mode == "profile" and ring is not None:
        agent = subprocess.Popen([sys.executable, "-c", _AGENT, str(ring)],
                                 stdout=subprocess.PIPE, text=True)
        while agent.poll() is None:  # keep calling NCCL so the pause point is reached
            step()
        torch.cuda.synchronize()
        words = (agent.stdout.read() if agent.stdout else "").split()
        gemm_ok = agent.returncode == 0 and bool(words) and words[0] == "DONE"
        gemm_ns = [int(w) for w in words[1:]]
    if reader is not None:
        time.sleep(0.5)  # let the poller complete the last events
        from greyhound import hookabi as H

        recs = reader.poll()
        ar = recs[recs["op"] == H.Op.ALLREDUCE]
        done = ar[(ar["flags"] & H.Flag.GPU_DONE) != 0]
        gpu_us = ((done["gpu_end_ns"].astype("int64") - done["gpu_start_ns"].astype("int64"))
                  / 1e3).tolist()
        out.update(records=len(ar), gpu_done=len(done),
                   gpu_us_median=round(statistics.median(gpu_us), 3) if gpu_us else None,
                   lost=reader.lost)
    out.update(gemm_ok=gemm_ok, gemm_ns=gemm_ns)
    dist.destroy_process_group()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
