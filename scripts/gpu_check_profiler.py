#!/usr/bin/env python3
"""The hook as real NCCL's profiler plugin, for scripts/gpu_check.sh (runs alone too).

With the hook preloaded and NCCL_PROFILER_PLUGIN naming it, NCCL dlopens the preloaded instance
at the first communicator and takes the newest interface it knows (NCCL 2.28: v5, 2.29+: v6).
Through PyTorch (one rank: NCCL refuses two on one GPU) the script runs a few collectives and a
send/receive to itself, in monitor mode and then in profile mode (where the hook switches the
costly event classes on), and reads what the plugin counted in the rank's ring: the interface
NCCL took, the mask it runs with, the events received per class in each phase, the kernel
channels seen, and whether the events were bound to the interposer's comm table. A one-rank
communicator has no network peer, so no network step events come (the multi-rank ones are
tested over the fake NCCL), and NCCL launches its collectives without tasks (ncclLaunchOneRank):
the send/receive to itself is what raises task, API and kernel events there.

GH_PROFILER_VIA=ctypes drives NCCL through ctypes instead of PyTorch (GH_NCCL_LIB names the
library): the CPU test suite runs it so against the fake NCCL. Prints one JSON line; exit status
0 when ok.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from greyhound import hookabi as H  # numpy only

CALLS = 20  # per kind and phase
CLASSES = [c for c in H.ProfileClass]


def events(reader: H.RingReader) -> dict[str, int]:
    g = reader.progress()
    return {c.name or str(c): int(g["events"][int(c).bit_length() - 1]) for c in CLASSES}


def minus(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a[k] - b.get(k, 0) for k in a if a[k] - b.get(k, 0)}


def torch_driver() -> tuple[Callable[[], None], Callable[[], None], str]:
    """Calls through PyTorch: all-reduce, all-gather, broadcast, reduce-scatter, a send/receive
    to itself; and the process group's teardown."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    x = torch.ones(1 << 20, device="cuda")
    out = torch.empty_like(x)

    def calls() -> None:
        for _ in range(CALLS):
            dist.all_reduce(x)
            dist.all_gather_into_tensor(out, x)
            dist.broadcast(x, 0)
            dist.reduce_scatter_tensor(out, x)
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 0), dist.P2POp(dist.irecv, out, 0)]):
                w.wait()
        torch.cuda.synchronize()

    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return calls, dist.destroy_process_group, nccl


class _Id(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def ctypes_driver() -> tuple[Callable[[], None], Callable[[], None], str]:
    """Calls through ctypes (no torch, no buffers: the fake NCCL reads none)."""
    ctypes.CDLL(os.environ.get("GH_NCCL_LIB", "libnccl.so.2"), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    nccl = ctypes.CDLL(None)  # the preloaded hook's ncclX come first in the global scope
    uid, comm, ver = _Id(), ctypes.c_void_p(), ctypes.c_int()
    if nccl.ncclGetUniqueId(ctypes.byref(uid)) or nccl.ncclCommInitRank(ctypes.byref(comm), 1, uid, 0):
        raise RuntimeError("ncclCommInitRank failed")
    nccl.ncclGetVersion(ctypes.byref(ver))

    def calls() -> None:
        for _ in range(CALLS):
            nccl.ncclAllReduce(None, None, ctypes.c_size_t(1 << 20), 7, 0, comm, None)
            nccl.ncclAllGather(None, None, ctypes.c_size_t(1 << 20), 7, comm, None)
            nccl.ncclGroupStart()
            nccl.ncclSend(None, ctypes.c_size_t(1024), 7, 0, comm, None)
            nccl.ncclRecv(None, ctypes.c_size_t(1024), 7, 0, comm, None)
            nccl.ncclGroupEnd()
        time.sleep(0.2)  # the fake's device finishes them

    return calls, lambda: nccl.ncclCommDestroy(comm), str(ver.value)


def main() -> int:
    out: dict[str, Any] = {"ok": False, "via": os.environ.get("GH_PROFILER_VIA", "torch")}
    hook = os.environ.get("LD_PRELOAD", "")
    os.environ.setdefault("NCCL_PROFILER_PLUGIN", hook)
    out["plugin"] = os.environ["NCCL_PROFILER_PLUGIN"]
    try:
        calls, teardown, out["nccl_version"] = (ctypes_driver() if out["via"] == "ctypes"
                                                else torch_driver())
        shm = Path(os.environ.get("GREYHOUND_SHM_DIR", "/dev/shm/greyhound"))
        (ring,) = H.list_rings(shm, os.environ.get("GREYHOUND_JOB_ID", "default"))
        reader = H.RingReader(ring)
        calls()
        monitor = events(reader)
        out["mask_default"] = hex(int(reader.progress()["mask_applied"]))
        ctl = reader.control()
        ctl.set_mode("profile")
        deadline = time.monotonic() + 10
        while int(reader.progress()["mask_applied"]) & int(H.ProfileClass.KERNEL_LAUNCH) == 0:
            if time.monotonic() > deadline:
                break
            calls()  # the mask applies at the next launch (or the poller's next pass)
        before = events(reader)
        calls()
        profile = minus(events(reader), before)
        out["mask_profile"] = hex(int(reader.progress()["mask_applied"]))
        ctl.set_mode("monitor")
        g = reader.progress()
        out.update(plugin_version=int(g["plugin_version"]), events_monitor=minus(monitor, {}),
                   events_profile=profile, unbound=int(g["unbound"]), dropped=int(g["dropped"]),
                   kernel_channels=int(((g["kch"]["key"] != 0) & (g["kch"]["starts"] > 0)).sum()),
                   network_slots=int((g["slots"]["key"] != 0).sum()), calls_per_phase=CALLS)
        teardown()
        v = out["plugin_version"]
        # bound: the caller's events met the interposed call (NCCL 2.28+ raises P2pApi inside it;
        # older ones raise a grouped send's task only at the group's end)
        out["ok"] = bool(v >= 3 and monitor.get("P2P", 0) >= 2 * CALLS
                         and (v < 5 or (out["unbound"] == 0 and profile.get("KERNEL_LAUNCH", 0) > 0)))
    except Exception as exc:  # the verdict says what went wrong; the run goes on
        out["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
