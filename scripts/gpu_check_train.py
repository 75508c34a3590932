#!/usr/bin/env python3
"""One single-rank PyTorch NCCL run for scripts/gpu_check.sh (not for direct use).

GH_CHECK=train (default): a short training loop. GH_MODE: none (no hook), monitor, or profile
(switched on through the control block after the ring appears). It measures ms per step and, at
the end, the host time per dist.all_reduce call (what the hook's record, completion mark and, in
profile mode, timing events cost on real NCCL). In profile mode it also drives one GEMM benchmark
through the pause path from a separate agent process, as the node agent would (the benchmark
first drains the rank's queued GPU work).

In every mode it reports the GPU memory the process holds (nvidia-smi --query-compute-apps, and
the device's used memory from cudaMemGetInfo), so a hooked run compares with an unhooked one, and,
hooked, the PCI bus id the hook recorded next to the one PyTorch reports for the device.

GH_CHECK=capture (GH_MODE none|monitor|profile): a CUDA graph captured in global mode (the
default of torch.cuda.graph) of all-reduces while another thread keeps calling NCCL on a
communicator of its own: the capture must succeed and replay, the hook must record nothing into
it (profile: CAPTURED records; monitor: lost marks) while the other thread's calls keep their
marks and times, and its poller must not invalidate the capture.

GH_CHECK=gputime (hook preloaded): GPU durations on real NCCL. A one-rank in-place all-reduce
launches nothing on the GPU, so this uses a communicator of its own through the hook's ncclX
(ctypes) and an out-of-place all-reduce of 64 MiB behind ~50 ms of torch.cuda._sleep: its GPU start
comes ~50 ms after the host enqueued it and its GPU duration is the copy's (the in-place one's, for
comparison, is ~0).

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
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.gpu_check_flag import gpu_flag, unregister

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
        from services.agent.collector import Collector
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


def gpu_memory() -> dict[str, Any]:
    """What this process holds on the GPU: nvidia-smi's per-process figure (None where its PID
    namespace hides the process) and the device's used memory from cudaMemGetInfo."""
    mib = None
    try:
        text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True,
                              timeout=20, check=False).stdout
        for line in text.splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 2 and parts[0] == str(os.getpid()) and parts[1].isdigit():
                mib = int(parts[1])
    except (OSError, subprocess.TimeoutExpired):
        pass
    free, total = torch.cuda.mem_get_info()
    return {"process_mib": mib, "device_used_mib": round((total - free) / 2**20),
            "torch_reserved_mib": round(torch.cuda.memory_reserved() / 2**20)}


def bus_ids(reader: Any | None) -> dict[str, Any]:
    """The PCI bus id the hook recorded for the device, and PyTorch's for device 0."""
    props = torch.cuda.get_device_properties(0)
    torch_bus = None
    if hasattr(props, "pci_bus_id"):
        domain, dev = int(getattr(props, "pci_domain_id", 0)), int(getattr(props, "pci_device_id", 0))
        torch_bus = f"{domain:04X}:{int(props.pci_bus_id):02X}:{dev:02X}.0"
    hook_bus = reader.refresh_header().pci_bus_id if reader is not None else None
    return {"pci_bus_id_hook": hook_bus, "pci_bus_id_torch": torch_bus,
            "gpu_api": int(reader.header.gpu_api) if reader is not None else None}


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
               gemm_drain_ns=gemm.get("drain_ns"), memory=gpu_memory(), **bus_ids(reader))
    dist.destroy_process_group()
    return out


def capture(mode: str) -> dict[str, Any]:
    """A global-mode graph capture of all-reduces while another thread calls NCCL."""
    from greyhound import hookabi as H

    dev = torch.device("cuda", 0)
    _init(dev)
    side_group = dist.new_group([0])  # a communicator of its own: one thread per communicator
    x, y = torch.ones(1 << 20, device=dev), torch.ones(1 << 20, device=dev)
    for _ in range(5):
        dist.all_reduce(x)
        dist.all_reduce(y, group=side_group)
    torch.cuda.synchronize()
    reader = None
    if mode != "none":
        reader = H.RingReader(_ring(), gpu_wait_ns=3_000_000_000)
        reader.poll()
        if mode == "profile":
            reader.control().set_mode("profile")
            dist.all_reduce(x)  # the event pool is made at a call on a stream not capturing
            torch.cuda.synchronize()
    stop, side_calls, side_err = threading.Event(), [0], []

    def side() -> None:
        s = torch.cuda.Stream()
        try:
            with torch.cuda.stream(s):
                while not stop.is_set():
                    dist.all_reduce(y, group=side_group)
                    side_calls[0] += 1
                    time.sleep(0.002)  # no synchronisation: illegal while another thread captures
        except Exception as e:  # reported, never raised in the thread
            side_err.append(f"{type(e).__name__}: {e}")

    t = threading.Thread(target=side, daemon=True)
    t.start()
    time.sleep(0.2)
    g, err, replayed = torch.cuda.CUDAGraph(), None, 0
    try:
        with torch.cuda.graph(g, capture_error_mode="global"):
            for _ in range(4):
                dist.all_reduce(x)
                time.sleep(0.02)  # the poller and the other thread act while we capture
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    stop.set()
    t.join(timeout=10)
    torch.cuda.synchronize()
    if err is None:
        for _ in range(5):
            g.replay()
            replayed += 1
        torch.cuda.synchronize()
    out: dict[str, Any] = {"mode": mode, "capture_error": err, "replayed": replayed,
                           "side_calls": side_calls[0], "side_error": side_err[:1]}
    if reader is not None:
        time.sleep(0.3)
        recs = reader.poll()
        ar = recs[recs["op"] == H.Op.ALLREDUCE]
        side_id = {int(c["comm_id"]) for c in reader.comms() if int(c["calls_entered"]) >= side_calls[0]}
        captured = ar[(ar["flags"] & H.Flag.CAPTURED) != 0]
        side_recs = ar[[int(c) in side_id for c in ar["comm_id"]]] if len(ar) else ar
        comms = reader.comms()
        out.update(captured_records=len(captured),
                   side_records=len(side_recs),
                   side_gpu_done=int(((side_recs["flags"] & H.Flag.GPU_DONE) != 0).sum()),
                   marks_lost=int(comms["gpu_marks_lost"].sum()),
                   marks=[{k: int(c[k]) for k in ("comm_id", "calls_entered", "gpu_calls_done",
                                                  "gpu_marks_lost", "gpu_pending_ns")} for c in comms])
    ok = err is None and replayed == 5 and side_calls[0] > 0 and not side_err
    if mode == "profile":
        ok = ok and out["captured_records"] >= 4 and out["side_gpu_done"] > 0
    elif mode == "monitor":
        ok = ok and out["marks_lost"] >= 4 and all(m["gpu_pending_ns"] == 0 for m in out["marks"])
    out["ok"] = bool(ok)
    dist.destroy_process_group()
    return out


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def _loaded_nccl() -> ctypes.CDLL:
    """The NCCL library torch loaded (RTLD_LOCAL: found by its path in /proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1] if "/" in line else ""
        if "libnccl" in Path(path).name and "greyhound" not in path:
            return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    raise RuntimeError("no libnccl in this process")


def gputime() -> dict[str, Any]:
    """GPU start and duration of an out-of-place all-reduce queued behind ~50 ms of GPU work."""
    from greyhound import hookabi as H

    dev = torch.device("cuda", 0)
    _init(dev)
    x = torch.ones(256, device=dev)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    real, hook = _loaded_nccl(), ctypes.CDLL(None)  # hook: the preloaded ncclX, recorded
    uid, comm = _UniqueId(), ctypes.c_void_p()
    if (real.ncclGetUniqueId(ctypes.byref(uid)) != 0
            or hook.ncclCommInitRank(ctypes.byref(comm), 1, uid, 0) != 0):
        return {"ok": False, "error": "a communicator through the hook's ncclCommInitRank failed"}
    n = 16 << 20  # floats: 64 MiB
    src, dst = torch.ones(n, device=dev), torch.zeros(n, device=dev)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

    def all_reduce(out: Any) -> int:
        return int(hook.ncclAllReduce(ctypes.c_void_p(src.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                                      ctypes.c_size_t(n), 7, 0, comm, stream))

    reader = H.RingReader(_ring(), gpu_wait_ns=5_000_000_000)
    cycles = _sleep_cycles_per_ms()
    res: dict[str, Any] = {}
    for mode in ("monitor", "profile"):
        reader.control().set_mode(mode)
        for _ in range(3):
            all_reduce(dst)
        torch.cuda.synchronize()
        time.sleep(0.05)
        reader.poll()
        torch.cuda._sleep(int(50 * cycles))
        rc = all_reduce(dst)
        time.sleep(0.01)
        during = _comm(reader)
        rc |= all_reduce(src)  # in place, for comparison
        torch.cuda.synchronize()
        time.sleep(0.1)
        recs = reader.poll()
        ar = recs[(recs["op"] == H.Op.ALLREDUCE) & (recs["count"] == n)]
        row: dict[str, Any] = {"rc": rc, "pending_while_queued": int(during["gpu_pending_ns"]) != 0,
                               "host_inside_nccl_while_queued": int(during["inflight_enter_ns"]) != 0}
        if mode == "profile" and len(ar) >= 2:
            for name, rec in (("out_of_place", ar[-2]), ("in_place", ar[-1])):
                start, end = int(rec["gpu_start_ns"]), int(rec["gpu_end_ns"])
                if int(rec["flags"]) & H.Flag.GPU_DONE:
                    row[name] = {"gpu_start_after_enqueue_ms": (start - int(rec["enter_ns"])) / 1e6,
                                 "gpu_duration_us": (end - start) / 1e3}
        res[mode] = row
    reader.control().set_mode("monitor")
    hook.ncclCommDestroy(comm)
    oop = res["profile"].get("out_of_place", {})
    mon = res["monitor"]
    res["ok"] = bool(mon["rc"] == 0 and mon["pending_while_queued"]
                     and not mon["host_inside_nccl_while_queued"]
                     and oop.get("gpu_start_after_enqueue_ms", 0) > 40.0
                     and oop.get("gpu_duration_us", 0) > 0.0)
    dist.destroy_process_group()
    return res


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
    flag = gpu_flag(libcuda, "gh-hang-")
    if isinstance(flag, str):
        return {"ok": False, "error": flag}
    page, dptr, flag_path = flag.page, ctypes.c_uint64(flag.dptr), flag.path
    marker, seen_path = str(flag_path.parent / "sync"), flag_path.parent / "seen.json"
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
    unregister(libcuda, flag)
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
    check, mode = os.environ.get("GH_CHECK", "train"), os.environ.get("GH_MODE", "none")
    if check == "async":
        out = check_async()
    elif check == "capture":
        out = capture(mode)
    elif check == "gputime":
        out = gputime()
    else:
        out = train(mode)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
