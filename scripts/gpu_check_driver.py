#!/usr/bin/env python3
"""The hook in a process with no shared CUDA runtime, for scripts/gpu_check.sh (runs alone too).

Real NCCL carries its own static CUDA runtime, and this process loads nothing else of CUDA but
the driver: no torch, no libcudart.so, only libnccl.so.2 and libcuda.so.1 (as a program built with
nvcc's default static runtime, or one using the driver API alone, would have). Through ctypes, with
the hook preloaded: the driver API makes the device's primary context current, allocates the
buffers and a stream; NCCL makes a one-rank communicator through the hook's wrappers. Then:

* the ring header says the marks rest on the driver API (gpu_api 2) and holds the device's PCI bus
  id as cuDeviceGetPCIBusId gives it;
* completion marks: an out-of-place all-reduce behind a gate (cuStreamWaitValue32 on a flag in a
  page registered with the GPU) is pending on the GPU while no host thread is inside NCCL, and
  done once the flag is written;
* profile mode: the next calls get GPU start and end times.

GH_NCCL_LIB names the NCCL library (default: the nvidia-nccl wheel's, else libnccl.so.2), so the
CPU test suite runs this against the fake NCCL and fake driver, where the gate is skipped (the fake
driver has no stream memory operations). Prints one JSON line; exit status 0 when ok.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from greyhound import hookabi as H  # numpy only: no CUDA runtime comes with it
from scripts.gpu_check_flag import gpu_flag, unregister

COUNT = 1 << 22  # floats: 16 MiB each way


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def nccl_path() -> str:
    lib = os.environ.get("GH_NCCL_LIB")
    if lib:
        return lib
    spec = importlib.util.find_spec("nvidia.nccl")  # the wheel torch links against; not torch
    for base in (spec.submodule_search_locations or []) if spec is not None else []:
        cand = Path(base) / "lib" / "libnccl.so.2"
        if cand.exists():
            return str(cand)
    return "libnccl.so.2"


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed ({rc})")


def comm_row(reader: H.RingReader) -> Any:
    comms = reader.comms()
    live = comms[comms["state"] == H.CommState.ACTIVE]
    return live[0] if len(live) else None


def main() -> int:
    out: dict[str, Any] = {"ok": False}
    cu = ctypes.CDLL("libcuda.so.1")
    check(cu.cuInit(0), "cuInit")
    dev, ctx, stream = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
    check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    bus = ctypes.create_string_buffer(32)
    check(cu.cuDeviceGetPCIBusId(bus, 32, dev), "cuDeviceGetPCIBusId")
    check(cu.cuStreamCreate(ctypes.byref(stream), 1), "cuStreamCreate")
    bufs = [ctypes.c_uint64(), ctypes.c_uint64()]
    for b in bufs:
        check(cu.cuMemAlloc_v2(ctypes.byref(b), ctypes.c_size_t(COUNT * 4)), "cuMemAlloc")
    lib = nccl_path()
    ctypes.CDLL(lib, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    nccl = ctypes.CDLL(None)  # the preloaded hook's ncclX come first in the global scope
    uid, comm = UniqueId(), ctypes.c_void_p()
    check(nccl.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    check(nccl.ncclCommInitRank(ctypes.byref(comm), 1, uid, 0), "ncclCommInitRank")

    def all_reduce() -> None:
        check(nccl.ncclAllReduce(ctypes.c_void_p(bufs[0].value), ctypes.c_void_p(bufs[1].value),
                                 ctypes.c_size_t(COUNT), 7, 0, comm, stream), "ncclAllReduce")

    for _ in range(5):
        all_reduce()
    check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
    ring = H.ring_path(Path(os.environ["GREYHOUND_SHM_DIR"]), os.environ.get("GREYHOUND_JOB_ID", "default"),
                       int(os.environ.get("RANK", "0")))
    reader = H.RingReader(ring, gpu_wait_ns=3_000_000_000)
    time.sleep(0.1)
    head = reader.refresh_header()
    maps = Path("/proc/self/maps").read_text()
    out.update(gpu_api=int(head.gpu_api), pci_bus_id_hook=head.pci_bus_id,
               pci_bus_id_driver=bus.value.decode(), libcudart_loaded="libcudart" in maps,
               nccl_lib=lib)
    row = comm_row(reader)
    out["marks"] = None if row is None else {k: int(row[k]) for k in (
        "gpu_marks", "calls_entered", "gpu_calls_done", "gpu_marks_lost")}
    out["gate"] = gate(cu, reader, all_reduce, stream)
    reader.poll()
    reader.control().set_mode("profile")
    for _ in range(4):
        all_reduce()
    check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
    time.sleep(0.2)
    recs = reader.poll()
    done = recs[(recs["op"] == H.Op.ALLREDUCE) & ((recs["flags"] & H.Flag.GPU_DONE) != 0)]
    dur = (done["gpu_end_ns"].astype("int64") - done["gpu_start_ns"].astype("int64")).tolist()
    out["profile"] = {"records": int((recs["op"] == H.Op.ALLREDUCE).sum()), "gpu_done": len(done),
                      "gpu_ns": dur}
    reader.control().set_mode("monitor")
    nccl.ncclCommDestroy(comm)
    marks = out["marks"] or {}
    g = out["gate"]
    out["ok"] = bool(
        out["gpu_api"] == int(H.GpuApi.DRIVER) and not out["libcudart_loaded"]
        and out["pci_bus_id_hook"] == out["pci_bus_id_driver"] and marks.get("gpu_marks") == 1
        and marks.get("gpu_calls_done", 0) >= 4 and (g.get("skipped") or g.get("ok"))
        and len(done) >= 3 and all(d >= 0 for d in dur))
    print(json.dumps(out))
    return 0 if out["ok"] else 1


def gate(cu: ctypes.CDLL, reader: H.RingReader, all_reduce: Any, stream: ctypes.c_void_p
         ) -> dict[str, Any]:
    """An all-reduce held on the GPU by a flag: pending while the host is out of NCCL, done after."""
    wait = getattr(cu, "cuStreamWaitValue32_v2", None) or getattr(cu, "cuStreamWaitValue32", None)
    if wait is None or getattr(cu, "cuMemHostRegister_v2", None) is None:
        return {"skipped": "no stream memory operations in this driver"}
    flag = gpu_flag(cu, "gh-drv-")
    if isinstance(flag, str):
        return {"ok": False, "error": flag}
    wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    try:
        if wait(stream, flag.dptr, 1, 0) != 0:  # CU_STREAM_WAIT_VALUE_GEQ
            return {"ok": False, "error": "cuStreamWaitValue32 failed"}
        all_reduce()
        time.sleep(0.5)
        held = comm_row(reader)
        now = time.monotonic_ns()
    finally:
        flag.release()
    check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
    time.sleep(0.05)
    after = comm_row(reader)
    unregister(cu, flag)
    pending_ns = int(held["gpu_pending_ns"])
    res = {"pending_age_s": round((now - pending_ns) / 1e9, 3) if pending_ns else 0,
           "host_inside_nccl": int(held["inflight_enter_ns"]) != 0,
           "pending_after_release": int(after["gpu_pending_ns"]) != 0,
           "done_after_release": int(after["gpu_calls_done"]) == int(after["calls_entered"])}
    res["ok"] = bool(res["pending_age_s"] > 0.3 and not res["host_inside_nccl"]
                     and not res["pending_after_release"] and res["done_after_release"])
    return res


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # a clear line for gpu_check.sh rather than a traceback alone
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))
        sys.exit(1)
