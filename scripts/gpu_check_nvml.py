#!/usr/bin/env python3
"""Real NVML through the node agent's sampler, for scripts/gpu_check.sh (runs alone too).

Opens NVML the way the agent does (services.agent.nvml.NvmlSampler), samples every GPU idle and
again while a PyTorch GEMM loop keeps GPU 0 busy (when torch and CUDA are there), polls Xid
events, times a sample, and cross-checks SM clock and temperature against nvidia-smi. Prints a
table per GPU and, last, one JSON line: ok is true when NVML opened, every GPU gave its SM
clock, temperature and throttle reasons, and nvidia-smi agrees within tolerance (not compared
without nvidia-smi, or when GREYHOUND_AGENT_NVML_LIB loads another library, e.g. the fake).
Fields the GPU does not support are reported as absent, not as failures. ``bus_ids`` lists each
GPU's PCI bus id as NVML gives it (what the agent matches the hook's against).

A bare PyTorch image has neither pydantic nor pynvml, which the agent's sampler needs: then the
same core facts (bus ids, SM clock, temperature, throttle reasons) are read straight from
libnvidia-ml.so.1 through ctypes, the result says ``"via": "ctypes"`` and why the sampler did
not run (GH_NVML_CTYPES=1 takes that path anyway).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if TYPE_CHECKING:
    from services.common.bus.contract import GpuSample

FIELDS = ("sm_clock_mhz", "sm_clock_max_mhz", "mem_clock_mhz", "throttle", "temperature_c",
          "power_w", "ecc_corrected", "ecc_uncorrected", "pcie_replays", "nvlink_links",
          "nvlink_errors")


def smi() -> dict[int, tuple[int, int]]:
    """nvidia-smi's (SM clock MHz, temperature C) per GPU index; {} without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return {}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,clocks.sm,temperature.gpu",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=10, check=False).stdout
    except subprocess.TimeoutExpired:
        return {}
    got = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and all(p.isdigit() for p in parts):
            got[int(parts[0])] = (int(parts[1]), int(parts[2]))
    return got


def busy(stop: threading.Event, running: threading.Event) -> str:
    """GEMMs on GPU 0 until stop (``running`` set once they run); what ran, or why nothing."""
    try:
        try:
            import torch
        except ImportError:
            return "no torch"
        if not torch.cuda.is_available():
            return "no CUDA"
        a = torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16)
        while not stop.is_set():
            for _ in range(8):
                a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize()
            running.set()
        return "GEMM loop on GPU 0"
    finally:
        running.set()


def table(title: str, samples: dict[int, GpuSample]) -> None:
    print(title)
    print(f"{'gpu':>3} {'SM MHz':>11} {'mem MHz':>8} {'temp C':>6} {'power W':>8} {'ECC c/u':>9} "
          f"{'PCIe rp':>7} {'NVLink':>6}  throttle")
    for i, g in samples.items():
        ecc = f"{g.ecc_corrected}/{g.ecc_uncorrected}" if g.ecc_corrected is not None else "-"
        nv = "-" if g.nvlink_links is None else str(g.nvlink_links)
        print(f"{i:>3} {g.sm_clock_mhz!s:>5}/{g.sm_clock_max_mhz!s:<5} {g.mem_clock_mhz!s:>8} "
              f"{g.temperature_c!s:>6} {g.power_w!s:>8} {ecc:>9} {g.pcie_replays!s:>7} {nv:>6}  "
              f"{','.join(g.throttle) or '-'}")


def agree_with(ref: dict[int, tuple[int, int]], got: dict[int, tuple[int | None, int | None]]
               ) -> dict[int, bool]:
    """nvidia-smi's SM clock and temperature against ours, read a moment apart under load: clocks
    move by a few bins, temperature by degrees."""
    out = {}
    for i, (sm, temp) in ref.items():
        mine = got.get(i)
        if mine is not None and mine[0] is not None and mine[1] is not None:
            out[i] = abs(mine[0] - sm) <= max(150, 0.15 * sm) and abs(mine[1] - temp) <= 5
    return out


class PciInfo(ctypes.Structure):
    """nvmlPciInfo_t (NVML 9.0+)."""

    _fields_ = [("busIdLegacy", ctypes.c_char * 16), ("domain", ctypes.c_uint), ("bus", ctypes.c_uint),
                ("device", ctypes.c_uint), ("pciDeviceId", ctypes.c_uint),
                ("pciSubSystemId", ctypes.c_uint), ("busId", ctypes.c_char * 32)]


def via_ctypes(lib: str | None, why: str) -> int:
    """The core facts straight from libnvidia-ml.so.1, without pynvml or pydantic."""
    res: dict[str, Any] = {"ok": False, "via": "ctypes", "sampler_not_run": why}
    try:
        nvml = ctypes.CDLL(lib or "libnvidia-ml.so.1")
    except OSError as exc:
        res["error"] = f"NVML did not open: {exc}"
        print(json.dumps(res))
        return 1
    if nvml.nvmlInit_v2() != 0:
        res["error"] = "NVML did not open"
        print(json.dumps(res))
        return 1
    try:
        count = ctypes.c_uint()
        nvml.nvmlDeviceGetCount_v2(ctypes.byref(count))
        stop, running = threading.Event(), threading.Event()
        what: list[str] = []
        worker = threading.Thread(target=lambda: what.append(busy(stop, running)), daemon=True)
        worker.start()
        running.wait(timeout=30)
        time.sleep(1.0)
        gpus: dict[int, dict[str, Any]] = {}
        for i in range(count.value):
            h = ctypes.c_void_p()
            if nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(i), ctypes.byref(h)) != 0:
                continue
            def ask(fn: Any, *args: Any, out: Any) -> Any:
                return out if fn(h, *args, ctypes.byref(out)) == 0 else None  # noqa: B023

            pci = ask(nvml.nvmlDeviceGetPciInfo_v3, out=PciInfo())
            sm = ask(nvml.nvmlDeviceGetClockInfo, 1, out=ctypes.c_uint())  # NVML_CLOCK_SM
            sm_max = ask(nvml.nvmlDeviceGetMaxClockInfo, 1, out=ctypes.c_uint())
            temp = ask(nvml.nvmlDeviceGetTemperature, 0, out=ctypes.c_uint())  # the GPU's
            reasons = ask(getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                          or nvml.nvmlDeviceGetCurrentClocksThrottleReasons, out=ctypes.c_ulonglong())
            gpus[i] = {"bus_id": pci.busId.decode() if pci is not None else None,
                       "sm_clock_mhz": sm.value if sm is not None else None,
                       "sm_clock_max_mhz": sm_max.value if sm_max is not None else None,
                       "temperature_c": temp.value if temp is not None else None,
                       "throttle_mask": reasons.value if reasons is not None else None}
        ref = smi() if lib is None else {}
        stop.set()
        worker.join(timeout=15)
    finally:
        nvml.nvmlShutdown()
    agree = agree_with(ref, {i: (g["sm_clock_mhz"], g["temperature_c"]) for i, g in gpus.items()})
    core_ok = bool(gpus) and all(g["sm_clock_mhz"] is not None and g["temperature_c"] is not None
                                 and g["throttle_mask"] is not None for g in gpus.values())
    res.update(ok=core_ok and all(agree.values()), gpus=len(gpus),
               bus_ids={str(i): g["bus_id"] for i, g in gpus.items()},
               loaded={str(i): g for i, g in gpus.items()},
               nvidia_smi_agrees={str(i): v for i, v in agree.items()},
               load=what[0] if what else None)
    for i, g in gpus.items():
        print(f"{i:>3} {g['bus_id']} SM {g['sm_clock_mhz']}/{g['sm_clock_max_mhz']} MHz "
              f"{g['temperature_c']} C throttle 0x{g['throttle_mask'] or 0:x}")
    print(json.dumps(res))
    return 0 if res["ok"] else 1


def main() -> int:
    lib = os.environ.get("GREYHOUND_AGENT_NVML_LIB") or None
    try:
        if os.environ.get("GH_NVML_CTYPES") == "1":
            raise ImportError("GH_NVML_CTYPES=1")
        from services.agent.nvml import NvmlSampler  # needs pydantic and pynvml
    except ImportError as exc:
        return via_ctypes(lib, f"{type(exc).__name__}: {exc}")
    sampler = NvmlSampler(lib, host="local")
    if not sampler.open():
        print(json.dumps({"ok": False, "error": "NVML did not open"}))
        return 1
    try:
        idle = sampler.sample()
        t0 = time.perf_counter()
        for _ in range(5):
            sampler.sample()
        ms_per_sample = (time.perf_counter() - t0) / 5 * 1e3
        table("idle:", idle)
        stop, running = threading.Event(), threading.Event()
        what: list[str] = []
        worker = threading.Thread(target=lambda: what.append(busy(stop, running)), daemon=True)
        worker.start()
        running.wait(timeout=30)  # CUDA start-up takes seconds
        time.sleep(3.0)
        loaded = sampler.sample()
        ref = smi() if lib is None else {}  # nvidia-smi reads the real driver, not another library
        stop.set()
        worker.join(timeout=15)
        table(f"under load ({what[0] if what else 'GEMM loop on GPU 0'}):", loaded)
        xids = sampler.poll_xids()
        buses = {i: g.bus for i, g in sampler.gpus.items()}
    finally:
        sampler.close()
    missing = {i: [f for f in FIELDS if getattr(g, f) is None] for i, g in loaded.items()}
    core_ok = bool(loaded) and all(g.sm_clock_mhz is not None and g.temperature_c is not None
                                   and g.throttle_mask is not None for g in loaded.values())
    agree = agree_with(ref, {i: (g.sm_clock_mhz, g.temperature_c) for i, g in loaded.items()})
    res: dict[str, Any] = {
        "ok": core_ok and all(agree.values()), "gpus": len(loaded), "via": "sampler",
        "bus_ids": {str(i): None if b is None else "{:08X}:{:02X}:{:02X}.{}".format(*b)
                    for i, b in buses.items()},
        "ms_per_sample_all_gpus": round(ms_per_sample, 3), "xids": [[i, e.code] for i, e in xids],
        "absent_fields": {str(i): f for i, f in missing.items() if f},
        "nvidia_smi_agrees": {str(i): v for i, v in agree.items()},
        "idle": {str(i): g.model_dump(include={"sm_clock_mhz", "temperature_c", "power_w", "throttle"})
                 for i, g in idle.items()},
        "loaded": {str(i): g.model_dump(include={"sm_clock_mhz", "temperature_c", "power_w",
                                                  "throttle"}) for i, g in loaded.items()},
    }
    print(f"one sample of {len(loaded)} GPU(s): {ms_per_sample:.2f} ms; Xids: {res['xids'] or 'none'}; "
          f"nvidia-smi agrees: {res['nvidia_smi_agrees'] or 'not compared'}")
    print(json.dumps(res))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
