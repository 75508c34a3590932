#!/usr/bin/env python3
"""One single-rank PyTorch NCCL run for scripts/gpu_check.sh (not for direct use).

GH_CHECK=train (default): a short training loop. GH_MODE: none (no hook), monitor, or profile
(switched on through the control block after the ring appears). It measures ms per step and, at
the end, the host time per dist.all_reduce call (what the hook's record, completion mark and, in
profile mode, timing events cost on real NCCL). In profile mode it also drives one GEMM benchmark
through the pause path from a separate agent process, as the node agent would (the benchmark
first drains the rank's queued GPU work).

GH_CHECK=async (hook preloaded): the GPU timeline on real NCCL. (a) A collective queued behind a
~50 ms GPU spin (torch.cuda._sleep): the host returns from the NCCL call within a millisecond, the
comm table shows it pending on the GPU, and profile mode reads its GPU start ~50 ms after the host
enqueued it. (b) A GPU-side hang: a collective gated by cuStreamWaitValue32 on a flag in a shared
page registered with the GPU; while the training thread waits in a stream synchronisation a
watcher process (the agent's view) sees the collective pending and ageing with no host thread
inside NCCL, runs the tracker's hang-watch core on the comm table when it can, then sets the flag;
the collective completes and the marks catch up.

Prints one JSON line with its measurements.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# Imported by name: torch exists only on the GPU machine, and mypy runs where it does not.
torch = importlib.import_module("torch")
dist = importlib.import_module("torch.distributed")

_AGENT = r"""
import json, sys, time
from pathlib import Path
from greyhound import hookabi as H
ctl = H.Control(Path(sys.argv[1]))
ctl.pause()
deadline = time.monotonic() + 60
out = {"state": "never paused"}
while not ctl.paused() and time.monotonic() < deadline:
    time.sleep(0.001)
if ctl.paused():
    rid = ctl.submit(H.BenchRequest(kind=H.BenchKind.GEMM, size=2048, repeat=5))
    res = None
    while res is None and time.monotonic() < deadline:
        res = ctl.result(rid)
        time.sleep(0.001)
    out = {"state": res.state.name if res else "timeout", "result": res.result if res else None,
           "durations_ns": list(res.durations_ns) if res else [], "drain_ns": res.drain_ns if res else None}
ctl.resume()
print(json.dumps(out))
sys.exit(0 if out["state"] == "DONE" else 1)
"""

# The agent's side of the hang check: it only reads the ring (and the tracker's core), then
# releases the GPU by writing the flag, whatever it saw, so the run can never stay hung.
_WATCHER = r"""
import json, mmap, os, struct, sys, time
from pathlib import Path
from greyhound import hookabi as H
ring, flag_path, marker, out_path, shm, job = sys.argv[1:7]
seen = {"samples": [], "hang_watch": None}
fd = os.open(flag_path, os.O_RDWR)
flag = mmap.mmap(fd, 4096)
os.close(fd)
try:
    reader = H.RingReader(Path(ring))
    deadline = time.monotonic() + 20
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.01)
    mon = col = None
    try:
        from greyhound.agent.collector import Collector
        from greyhound.core.job_hangs import COUNTER_FIELDS, JobHangMonitor
        col = Collector(Path(shm), job)
        col.scan()
        try:
            mon = JobHangMonitor(floor_s=1.0, multiple=1.0)
        except TypeError:
            mon = JobHangMonitor()
    except Exception as e:
        seen["hang_watch"] = f"not run: {type(e).__name__}: {e}"
    for _ in range(15):
        now = time.monotonic_ns()
        rows = []
        for c in reader.comms():
            if int(c["state"]) == H.CommState.ACTIVE and int(c["calls_entered"]) > 0:
                rows.append({k: int(c[k]) for k in (
                    "comm_id", "calls_entered", "calls_completed", "last_seq_entered", "inflight_enter_ns",
                    "gpu_marks", "gpu_calls_done", "gpu_seq_done", "gpu_pending_ns", "gpu_pending_seq",
                    "gpu_pending_op", "gpu_marks_lost")} | {"now_ns": now})
        seen["samples"].append(rows)
        if mon is not None:
            try:
                cr = col.counters(now)
                mon.observe_counters(now / 1e9, {f: getattr(cr, f) for f in COUNTER_FIELDS})
            except Exception as e:
                seen["hang_watch"] = f"failed: {type(e).__name__}: {e}"
                mon = None
        time.sleep(0.2)
    if mon is not None:
        try:
            found = mon.check(time.monotonic_ns() / 1e9)
            seen["hang_watch"] = {"findings": [repr(f) for f in found]}
        except Exception as e:
            seen["hang_watch"] = f"failed: {type(e).__name__}: {e}"
    seen["marker_present"] = os.path.exists(marker)
    seen["main_returned_early"] = os.path.exists(marker + ".done")
finally:
    flag[0:4] = struct.pack("<I", 1)  # release the GPU
    flag.flush()
    Path(out_path).write_text(json.dumps(seen))
"""


def _ring() -> Path:
    from greyhound import hookabi as H

    return H.ring_path(Path(os.environ["GREYHOUND_SHM_DIR"]), os.environ["GREYHOUND_JOB_ID"], 0)


def _init(dev: Any) -> None:
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)


def _per_call_us(x: Any, calls: int = 500, rounds: int = 7) -> float:
    """Host time per dist.all_reduce of a 1 KiB tensor: the enqueue loop only (the GPU keeps up)."""
    per = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(x)
        per.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return round(statistics.median(per), 3)


def train(mode: str) -> dict[str, Any]:
    steps = int(os.environ.get("GH_STEPS", "300"))
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    _init(dev)
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
        loss.item()  # one synchronisation per step, as a training loop reading its loss

    for _ in range(20):  # warm-up: NCCL init, ring creation, autotuning
        step()
    torch.cuda.synchronize()
    reader = None
    if mode != "none":
        from greyhound import hookabi as H

        ring = _ring()
        if not ring.exists():
            raise SystemExit(f"gpu_check: the hook made no ring at {ring}")
        reader = H.RingReader(ring, gpu_wait_ns=3_000_000_000)
        reader.poll()
        if mode == "profile":
            reader.control().set_mode("profile")
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    out: dict[str, Any] = {"mode": mode, "ms_per_step": round(ms, 4), "device": torch.cuda.get_device_name(0)}
    gemm: dict[str, Any] = {}
    if mode == "profile":
        agent = subprocess.Popen([sys.executable, "-c", _AGENT, str(_ring())], stdout=subprocess.PIPE,
                                 text=True)
        while agent.poll() is None:  # keep calling NCCL so the pause point is reached
            step()
        torch.cuda.synchronize()
        text = agent.stdout.read() if agent.stdout else ""
        gemm = json.loads(text) if text.strip() else {"state": "no output"}
    small = torch.ones(256, device=dev)
    for _ in range(200):
        dist.all_reduce(small)
    out["us_per_allreduce_call"] = _per_call_us(small)
    if reader is not None:
        time.sleep(0.5)  # let the poller complete the last events
        from greyhound import hookabi as H

        recs = reader.poll()
        ar = recs[recs["op"] == H.Op.ALLREDUCE]
        done = ar[(ar["flags"] & H.Flag.GPU_DONE) != 0]
        gpu_us = ((done["gpu_end_ns"].astype("int64") - done["gpu_start_ns"].astype("int64")) / 1e3).tolist()
        comms = reader.comms()
        live = comms[comms["calls_entered"] > 0]
        out.update(records=len(ar), gpu_done=len(done),
                   gpu_us_median=round(statistics.median(gpu_us), 3) if gpu_us else None, lost=reader.lost,
                   gpu_marks=int(live["gpu_marks"].min()) if len(live) else 0,
                   marks_behind=(int((live["calls_entered"] - live["gpu_calls_done"]).max())
                                 if len(live) else None),
                   marks_lost=int(live["gpu_marks_lost"].sum()) if len(live) else None)
    out.update(gemm_ok=gemm.get("state") == "DONE", gemm_ns=gemm.get("durations_ns", []),
               gemm_drain_ns=gemm.get("drain_ns"))
    dist.destroy_process_group()
    return out


def _sleep_cycles_per_ms() -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(20_000_000)
    b.record()
    torch.cuda.synchronize()
    return 20_000_000 / max(float(a.elapsed_time(b)), 1e-3)


def _comm(reader: Any) -> Any:
    """The entry of the communicator the all-reduces go to: the busiest active one."""
    from greyhound import hookabi as H

    comms = reader.comms()
    live = comms[(comms["state"] == H.CommState.ACTIVE) & (comms["calls_entered"] > 0)]
    return live[int(live["calls_entered"].argmax())]


def queued(reader: Any, x: Any, cycles_per_ms: float) -> dict[str, Any]:
    """(a) a collective queued behind ~50 ms of GPU work."""
    from greyhound import hookabi as H

    out: dict[str, Any] = {}
    for mode in ("monitor", "profile"):
        reader.control().set_mode(mode)
        for _ in range(3):  # profile mode makes its event pool at its first call
            dist.all_reduce(x)
        torch.cuda.synchronize()
        time.sleep(0.05)
        reader.poll()
        torch.cuda._sleep(int(50 * cycles_per_ms))
        t0 = time.perf_counter()
        dist.all_reduce(x)
        host_ms = (time.perf_counter() - t0) * 1e3
        time.sleep(0.01)  # the poller passes every millisecond
        during = _comm(reader)
        torch.cuda.synchronize()
        time.sleep(0.05)
        after = _comm(reader)
        recs = reader.poll()
        ar = recs[recs["op"] == H.Op.ALLREDUCE]
        rec = ar[-1] if len(ar) else None
        in_call = None if rec is None else (int(rec["return_ns"]) - int(rec["enter_ns"])) / 1e6
        row: dict[str, Any] = {
            "host_ms_in_all_reduce": round(host_ms, 3), "host_ms_in_nccl_call": in_call,
            "pending_while_queued": int(during["gpu_pending_ns"]) != 0,
            "pending_seq": int(during["gpu_pending_seq"]),
            "record_seq": None if rec is None else int(rec["seq"]),
            "inflight_while_queued": int(during["inflight_enter_ns"]) != 0,
            "seq_done_after_sync": int(after["gpu_seq_done"]),
            "pending_after_sync": int(after["gpu_pending_ns"]) != 0,
        }
        if mode == "profile" and rec is not None and int(rec["flags"]) & H.Flag.GPU_DONE:
            row["gpu_start_after_enqueue_ms"] = (int(rec["gpu_start_ns"]) - int(rec["enter_ns"])) / 1e6
            row["gpu_duration_ms"] = (int(rec["gpu_end_ns"]) - int(rec["gpu_start_ns"])) / 1e6
        out[mode] = row
    reader.control().set_mode("monitor")
    m, p = out["monitor"], out["profile"]
    out["ok"] = bool(
        m["host_ms_in_all_reduce"] < 1.0 and m["pending_while_queued"] and not m["inflight_while_queued"]
        and m["pending_seq"] == m["record_seq"] and m["seq_done_after_sync"] >= (m["record_seq"] or 0)
        and not m["pending_after_sync"] and p.get("gpu_start_after_enqueue_ms", 0) > 40.0
        and p.get("gpu_duration_ms", 1e9) < 10.0)
    return out


def hang(reader: Any, x: Any) -> dict[str, Any]:
    """(b) a collective hung on the GPU (gated on a flag), observed from outside the process."""
    libcuda = ctypes.CDLL("libcuda.so.1")
    wait = getattr(libcuda, "cuStreamWaitValue32_v2", None) or libcuda.cuStreamWaitValue32
    wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # tmpfs pages pin reliably
    work = Path(tempfile.mkdtemp(prefix="gh-hang-", dir=shm))
    flag_path, marker, seen_path = work / "flag", str(work / "sync"), work / "seen.json"
    flag_path.write_bytes(b"\0" * 4096)
    fd = os.open(flag_path, os.O_RDWR)
    page = mmap.mmap(fd, 4096)
    os.close(fd)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(page))
    dptr = ctypes.c_uint64()
    rc = libcuda.cuMemHostRegister_v2(ctypes.c_void_p(addr), ctypes.c_size_t(4096), ctypes.c_uint(0x02))
    if rc == 0:
        rc = libcuda.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ctypes.c_void_p(addr), ctypes.c_uint(0))
    if rc != 0:
        return {"ok": False, "error": f"registering the flag page failed (CUresult {rc})"}
    torch.cuda.synchronize()
    before = _comm(reader)
    watcher = subprocess.Popen([sys.executable, "-c", _WATCHER, str(_ring()), str(flag_path), marker,
                                str(seen_path), os.environ["GREYHOUND_SHM_DIR"],
                                os.environ["GREYHOUND_JOB_ID"]])
    stream = torch.cuda.current_stream().cuda_stream
    rc = wait(ctypes.c_void_p(stream), dptr, 1, 0)  # CU_STREAM_WAIT_VALUE_GEQ
    if rc != 0:
        page[0:4] = (1).to_bytes(4, "little")
        watcher.wait(60)
        return {"ok": False, "error": f"cuStreamWaitValue32 failed (CUresult {rc})"}
    # Whatever happens to the watcher, the GPU is released after 30 s (the synchronisation below
    # releases the GIL while it waits).
    safety = threading.Timer(30.0, lambda: page.__setitem__(slice(0, 4), (1).to_bytes(4, "little")))
    safety.start()
    dist.all_reduce(x)  # gated: the NCCL stream waits for the current stream
    dist.all_reduce(x)  # the host runs on past the hung collective
    Path(marker).write_text(str(time.monotonic_ns()))
    t0 = time.perf_counter()
    torch.cuda.synchronize()  # the training thread blocks here, outside NCCL
    blocked_s = time.perf_counter() - t0
    safety.cancel()
    Path(marker + ".done").write_text("")
    watcher.wait(60)
    time.sleep(0.05)
    after = _comm(reader)
    seen = json.loads(seen_path.read_text()) if seen_path.exists() else {"samples": []}
    libcuda.cuMemHostUnregister(ctypes.c_void_p(addr))
    hung = int(before["last_seq_entered"]) + 1
    samples = [r for rows in seen["samples"] for r in rows if r["comm_id"] == int(before["comm_id"])]
    ages = [(r["now_ns"] - r["gpu_pending_ns"]) / 1e9 for r in samples if r["gpu_pending_ns"]]
    out = {
        "blocked_in_sync_s": round(blocked_s, 3), "hung_seq": hung,
        "samples": len(samples), "pending_samples": len(ages),
        "pending_seq_seen": sorted({r["gpu_pending_seq"] for r in samples}),
        "pending_age_first_s": round(ages[0], 3) if ages else None,
        "pending_age_last_s": round(ages[-1], 3) if ages else None,
        "host_inside_nccl_samples": sum(r["inflight_enter_ns"] != 0 for r in samples),
        "host_seq_entered_seen": sorted({r["last_seq_entered"] for r in samples}),
        "seq_done_after_release": int(after["gpu_seq_done"]),
        "pending_after_release": int(after["gpu_pending_ns"]) != 0,
        "hang_watch": seen.get("hang_watch"), "watcher_saw_sync": seen.get("marker_present"),
    }
    out["ok"] = bool(
        ages and out["pending_seq_seen"] == [hung] and ages[-1] > ages[0] + 1.0
        and out["host_inside_nccl_samples"] == 0 and hung + 1 in out["host_seq_entered_seen"]
        and blocked_s > 1.5 and out["seq_done_after_release"] >= hung + 1
        and not out["pending_after_release"])
    return out


def check_async() -> dict[str, Any]:
    from greyhound import hookabi as H

    dev = torch.device("cuda", 0)
    _init(dev)
    x = torch.ones(256, device=dev)
    for _ in range(20):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    ring = _ring()
    if not ring.exists():
        raise SystemExit(f"gpu_check: the hook made no ring at {ring}")
    reader = H.RingReader(ring, gpu_wait_ns=3_000_000_000)
    reader.poll()
    cycles = _sleep_cycles_per_ms()
    out = {"sleep_cycles_per_ms": round(cycles), "queued": queued(reader, x, cycles), "hang": hang(reader, x)}
    dist.destroy_process_group()
    return out


def main() -> int:
    check = os.environ.get("GH_CHECK", "train")
    out = check_async() if check == "async" else train(os.environ.get("GH_MODE", "none"))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
