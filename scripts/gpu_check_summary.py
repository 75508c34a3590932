#!/usr/bin/env python3
"""The summary of scripts/gpu_check.sh: its steps' JSON results (in the directory given) into one
verdict, written to result.json there and printed, last, as RESULT {json}. Plain Python (no
numpy, no pydantic): it runs on a bare PyTorch image, and anywhere over results copied from one.
Exit status 0 when every check held."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

_PCI = re.compile(r"^\s*(?:([0-9A-Fa-f]+):)?([0-9A-Fa-f]{1,2}):([0-9A-Fa-f]{1,2})\.([0-7])\s*$")
# What the hook may add to a process's GPU memory: its events (monitor: 1024 timing-free ones per
# communicator; profile: 2 x 1024 timing ones) are driver objects of a few hundred bytes each.
MAX_ADDED_MIB = {"monitor": 128, "profile": 256}


def bus(text: str | None) -> tuple[int, int, int, int] | None:
    """A PCI address as numbers: CUDA writes the domain with 4 digits, NVML with 8."""
    m = _PCI.match(text or "")
    if m is None:
        return None
    return int(m.group(1) or "0", 16), int(m.group(2), 16), int(m.group(3), 16), int(m.group(4))


def _mib(run: dict[str, Any]) -> int | None:
    m = run.get("memory") or {}
    got = m.get("process_mib") if m.get("process_mib") is not None else m.get("device_used_mib")
    return None if got is None else int(got)


def summarise(res_dir: Path) -> dict[str, Any]:
    def load(name: str) -> dict[str, Any]:
        p = res_dir / f"{name}.json"
        got: dict[str, Any] = json.loads(p.read_text()) if p.exists() else {"ok": False, "error": "not run"}
        return got

    base, mon, prof = load("base"), load("monitor"), load("profile")
    cap = {m: load(f"capture_{m}") for m in ("base", "monitor", "profile")}
    gpt, asy, drv, nvml = load("gputime"), load("async"), load("driver"), load("nvml")
    pause, prof_plugin = load("pause"), load("profiler")
    train_ok = bool(mon.get("records", 0) > 0 and mon.get("gpu_marks") == 1
                    and prof.get("gpu_done", 0) > 0 and prof.get("gemm_ok"))
    q, h = asy.get("queued", {}), asy.get("hang", {})
    nvml_ids = sorted(b for b in (nvml.get("bus_ids") or {}).values() if b)
    hook_bus, torch_bus = bus(mon.get("pci_bus_id_hook")), bus(mon.get("pci_bus_id_torch"))
    pci_ok = (hook_bus is not None and hook_bus in {bus(b) for b in nvml_ids}
              and (torch_bus is None or torch_bus == hook_bus))
    mem: dict[str, Any] = {"unhooked_mib": _mib(base), "monitor_mib": _mib(mon), "profile_mib": _mib(prof)}
    if None not in mem.values():
        for mode in MAX_ADDED_MIB:
            mem[f"added_{mode}_mib"] = mem[f"{mode}_mib"] - mem["unhooked_mib"]
    mem["ok"] = all(mem.get(f"added_{m}_mib", 1 << 30) <= cap_mib for m, cap_mib in MAX_ADDED_MIB.items())
    # A capture the unhooked run cannot hold either is the environment's, not the hook's: it is
    # reported, and the hooked runs are what the verdict rests on.
    cap_ok = bool(cap["monitor"].get("ok") and cap["profile"].get("ok"))
    runs = (("unhooked", base), ("monitor", mon), ("profile", prof))
    res: dict[str, Any] = {
        "ok": bool(train_ok and q.get("ok") and h.get("ok") and cap_ok and gpt.get("ok")
                   and drv.get("ok") and nvml.get("ok") and pci_ok and mem["ok"]
                   and pause.get("ok") and prof_plugin.get("ok")),
        "train_ok": train_ok, "queued_ok": q.get("ok"), "hang_ok": h.get("ok"), "capture_ok": cap_ok,
        "capture_unhooked_ok": cap["base"].get("ok"), "gputime_ok": gpt.get("ok"),
        "driver_ok": drv.get("ok"), "nvml_ok": nvml.get("ok"), "pci_ok": pci_ok, "memory_ok": mem["ok"],
        "pause_ok": bool(pause.get("ok")), "profiler_ok": bool(prof_plugin.get("ok")),
        "profiler": {k: prof_plugin.get(k) for k in (
            "nccl_version", "plugin_version", "mask_default", "mask_profile", "events_monitor",
            "events_profile", "unbound", "dropped", "error")},
        "ms_per_step": {k: r.get("ms_per_step") for k, r in runs},
        "us_per_allreduce_call": {k: r.get("us_per_allreduce_call") for k, r in runs},
        "gpu_memory": mem,
        "pci_bus_id": {"hook": mon.get("pci_bus_id_hook"), "torch": mon.get("pci_bus_id_torch"),
                       "nvml": nvml_ids},
        "gputime": gpt, "capture": cap, "driver": drv, "queued": q, "hang": h, "pause": pause,
        "nvml_via": nvml.get("via"), "device": prof.get("device"),
        "skipped": sorted(p.stem for p in res_dir.glob("*.json")
                          if p.stem != "result" and "skipped" in json.loads(p.read_text())),
    }
    return res


def main() -> int:
    res_dir = Path(sys.argv[1])
    res = summarise(res_dir)
    (res_dir / "result.json").write_text(json.dumps(res, indent=1))
    cap, gpt, drv, mem = res["capture"], res["gputime"], res["driver"], res["gpu_memory"]
    print(f"training: ms/step {res['ms_per_step']}; us per all_reduce {res['us_per_allreduce_call']} -> "
          f"{'ok' if res['train_ok'] else 'FAILED'}")
    print(f"capture (global mode, another thread calling NCCL): unhooked {cap['base'].get('ok')}, "
          f"monitor {cap['monitor'].get('ok')}, profile {cap['profile'].get('ok')}")
    oop = (gpt.get("profile") or {}).get("out_of_place", {})
    print(f"GPU time of an out-of-place all-reduce behind 50 ms: start "
          f"{oop.get('gpu_start_after_enqueue_ms')} ms after enqueue, {oop.get('gpu_duration_us')} us "
          f"on the GPU -> {'ok' if res['gputime_ok'] else 'FAILED'}")
    print(f"GPU memory {mem}; PCI bus id {res['pci_bus_id']} -> {'ok' if res['pci_ok'] else 'FAILED'}")
    print(f"driver API only (no libcudart): api {drv.get('gpu_api')}, marks {drv.get('marks')}, gate "
          f"{drv.get('gate')} -> {'ok' if res['driver_ok'] else 'FAILED: ' + str(drv.get('error', ''))}")
    pz = res["pause"]
    print(f"pause: groups {(pz.get('groups') or {}).get('ok')}, lonely send "
          f"{(pz.get('lonely_send') or {}).get('ok')}, 25 s pause against a 20 s timeout "
          f"{(pz.get('timeout_cap') or {}).get('ok')} (held "
          f"{(pz.get('timeout_cap') or {}).get('held_s')} s) -> "
          f"{'ok' if res['pause_ok'] else 'FAILED: ' + str(pz.get('error', ''))}")
    pp = res["profiler"]
    print(f"profiler plugin in NCCL {pp.get('nccl_version')}: interface v{pp.get('plugin_version')}, "
          f"events {pp.get('events_monitor')}, in profile mode {pp.get('events_profile')} -> "
          f"{'ok' if res['profiler_ok'] else 'FAILED: ' + str(pp.get('error') or '')}")
    print(f"queued {res['queued_ok']}, hung on the GPU {res['hang_ok']} (hang watch: "
          f"{res['hang'].get('hang_watch')}); nvml via {res['nvml_via']}: {res['nvml_ok']}; "
          f"skipped {res['skipped'] or 'none'}; results in {res_dir}")
    brief = {k: v for k, v in res.items() if k not in ("capture", "driver", "queued", "hang", "pause")}
    print("RESULT " + json.dumps(brief))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
