#!/usr/bin/env python3
"""What CCL-D's progress counters through NCCL's profiler plugin cost: host time per NCCL call
with the plugin off, with its default event classes and with the costly ones on, and the memory
it takes per rank, against the reference (CCL-D's 1,184 bytes per rank, and the same calls with
no hook at all).

The overhead driver of bench/hook_overhead.py (native/build/tests/bench_calls) calls
ncclAllReduce against the fake NCCL in no-op mode: nothing is enqueued, but a loaded profiler
plugin still gets the events the caller's thread raises for each call, as NCCL 2.28 raises them
(GroupApi, CollApi, Group, Coll and, with the costly classes, KernelLaunch: the fake plays v5).
So the variants differ only by what the caller pays: no hook; the hook with no plugin (its
interposer: ring record and completion mark); a plugin that does nothing (what NCCL's own event
dispatch costs, with the same masks); the hook named as the plugin with its default mask; with
every class on (GREYHOUND_PROFILER_MASK). Network and kernel events run on NCCL's
proxy thread, not the caller's, and are not in these numbers. Rounds rotate the variants, all
pinned to one CPU; the headline of each is the median over rounds of its fastest repeat (other
tenants of a shared machine only ever add time).

Memory: the ring region the agent reads (gh_progress, fixed: 64 network slots, 32 kernel channel
slots, the counts per class) and the plugin's process-local pools (contexts, task and op
records), read from the built library's symbol table. Neither grows with the job's size.

Last line: RESULT {json} with ns_per_call_off, ns_per_call_default, ns_per_call_full and
bytes_per_rank (the ring region; bytes_per_rank_process adds the pools).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.hook_overhead import pin_one_cpu  # noqa: E402
from greyhound import hookabi as H  # noqa: E402

NATIVE = REPO / "native"
BUILD = NATIVE / "build"
CALLS, REPEATS, ROUNDS = 20_000, 9, 7
CCLD_BYTES_PER_RANK = 1184
POOLS = ("ctxs", "tasks", "ops", "kch_handles")
FULL_MASK = (1 << 12) - 1  # every class NCCL 2.28 knows


def run(driver: Path, env: dict[str, str]) -> tuple[float, float]:
    """(median, fastest) ns per call over the driver's repeats."""
    out = subprocess.run([str(driver), str(CALLS), str(REPEATS)], env=env, check=True,
                         capture_output=True, text=True, timeout=300).stdout.split()
    return float(out[0]), float(out[1])


def pool_bytes(lib: Path) -> dict[str, int]:
    """Sizes of the plugin's static pools in the built library (nm -S)."""
    out = subprocess.run(["nm", "-S", "--defined-only", str(lib)], capture_output=True, text=True,
                         check=True).stdout
    sizes: dict[str, int] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[3] in POOLS:
            sizes[parts[3]] = int(parts[1], 16)
    return sizes


def events_per_call(driver: Path, env: dict[str, str], shm: Path) -> dict[str, float]:
    """Events the plugin received per call, by class (one kept ring read afterwards)."""
    subprocess.run([str(driver), "2000", "1"], env=dict(env, GREYHOUND_RING_KEEP="1"), check=True,
                   capture_output=True, timeout=120)
    (ring,) = H.list_rings(shm, "bench")
    reader = H.RingReader(ring)
    g = reader.progress()
    calls = 1 + 2000 // 10 + 2000
    reader.close()
    ring.unlink()
    return {H.ProfileClass(1 << i).name or str(i): round(int(n) / calls, 2)
            for i, n in enumerate(g["events"][:15]) if n}


def main() -> int:
    subprocess.run(["make", "-s", "-C", str(NATIVE)], check=True)
    driver = BUILD / "tests" / "bench_calls"
    hook = BUILD / "libgreyhound_hook.so"
    cpu = pin_one_cpu()
    with tempfile.TemporaryDirectory() as tmpdir:
        shm = Path(tmpdir) / "shm"
        base = dict(os.environ, FAKE_NCCL_NOOP="1", RANK="0", WORLD_SIZE="1",
                    LD_LIBRARY_PATH=f"{BUILD / 'tests' / 'stubcuda'}:{BUILD / 'fake'}",
                    GREYHOUND_SHM_DIR=str(shm), GREYHOUND_JOB_ID="bench")
        for name in ("LD_PRELOAD", "NCCL_PROFILER_PLUGIN", "GREYHOUND_PROFILER_MASK"):
            base.pop(name, None)
        hooked = dict(base, LD_PRELOAD=str(hook))
        plugin = dict(hooked, NCCL_PROFILER_PLUGIN=str(hook))
        null = dict(hooked, NCCL_PROFILER_PLUGIN=str(BUILD / "tests" / "libnull_profiler.so"))
        variants = {"none": base, "off": hooked, "null": null,
                    "null_full": dict(null, GREYHOUND_PROFILER_MASK=str(FULL_MASK)),
                    "default": plugin, "full": dict(plugin, GREYHOUND_PROFILER_MASK=str(FULL_MASK))}
        got: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
        names = list(variants)
        for rnd in range(ROUNDS):
            for name in names[rnd % len(names):] + names[: rnd % len(names)]:
                got[name].append(run(driver, variants[name]))
        per_call = {k: events_per_call(driver, variants[k], shm) for k in ("default", "full")}
    fastest = {k: statistics.median(r[1] for r in v) for k, v in got.items()}
    median = {k: statistics.median(r[0] for r in v) for k, v in got.items()}
    ring_bytes = H.PROGRESS_DTYPE.itemsize
    pools = pool_bytes(hook)
    process_bytes = ring_bytes + sum(pools.values())

    print(f"{'variant':<44}{'ns/call fastest':>16}{'ns/call median':>16}   rounds (fastest repeat)")
    labels = {"none": "fake NCCL, no hook (reference)", "off": "hook, no profiler plugin",
              "null": "hook + a plugin doing nothing, default",
              "null_full": "hook + a plugin doing nothing, all",
              "default": "hook + plugin, default classes", "full": "hook + plugin, every class on"}
    for k, label in labels.items():
        print(f"{label:<44}{fastest[k]:>16.1f}{median[k]:>16.1f}   "
              f"{' '.join(f'{r[1]:.1f}' for r in got[k])}")
    print(f"added per call with the plugin: default {fastest['default'] - fastest['off']:.1f} ns, "
          f"every class {fastest['full'] - fastest['off']:.1f} ns (over the hook without it), of "
          f"which NCCL's own event dispatch (a plugin doing nothing) "
          f"{fastest['null'] - fastest['off']:.1f} and {fastest['null_full'] - fastest['off']:.1f} ns")
    for k, ev in per_call.items():
        print(f"events per call on the caller's thread, {k}: {ev}")
    print(f"{'memory per rank':<44}{'bytes':>16}")
    print(f"{'CCL-D (published, per rank)':<44}{CCLD_BYTES_PER_RANK:>16}")
    print(f"{'ours: ring region (gh_progress)':<44}{ring_bytes:>16}")
    for name, size in sorted(pools.items()):
        print(f"{'ours: process pool ' + name:<44}{size:>16}")
    print(f"{'ours: total':<44}{process_bytes:>16}")
    print(f"{CALLS} calls x {REPEATS} repeats x {ROUNDS} rotated rounds, pinned to CPU {cpu}; "
          f"fixed whatever the job's size: {H.PROG_SLOTS} network slots, {H.KCH_SLOTS} kernel "
          "channel slots")
    result = {"ns_per_call_off": round(fastest["off"], 2),
              "ns_per_call_default": round(fastest["default"], 2),
              "ns_per_call_full": round(fastest["full"], 2),
              "ns_per_call_unhooked": round(fastest["none"], 2),
              "ns_added_default": round(fastest["default"] - fastest["off"], 2),
              "ns_added_full": round(fastest["full"] - fastest["off"], 2),
              "ns_dispatch_default": round(fastest["null"] - fastest["off"], 2),
              "ns_dispatch_full": round(fastest["null_full"] - fastest["off"], 2),
              "bytes_per_rank": ring_bytes, "bytes_per_rank_process": process_bytes,
              "bytes_per_rank_ccld": CCLD_BYTES_PER_RANK, "events_per_call": per_call,
              "calls": CALLS, "repeats": REPEATS, "rounds": ROUNDS, "pinned_cpu": cpu,
              "profiler_interface": 5}
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
