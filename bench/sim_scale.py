#!/usr/bin/env python3
"""Simulator throughput: offline iterations per second at 4,096 GPUs, ours against a reference.

The reference is a straightforward per-event Python implementation of the same model (1F1B by
dependency passes, one Python object per NCCL call); it must agree with ours on the iteration
time, and is timed at 256 GPUs where it is bearable. ``live_256_speed`` is the live mode's
virtual seconds per wall second for a 256-GPU job (TP8 DP16 PP2), every rank's ring drained by
the real node agent publishing to NATS JetStream and the tracker consuming it (embedded NATS and
Postgres, services as subprocesses), as fast as the agent keeps up.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from greyhound.sim.model import ClusterModel
from greyhound.sim.offline import run_offline
from greyhound.sim.scenario import JobSpec, Scenario, parse_scenario
from greyhound.sim.schedule import stage_ops


def make(tp: int, dp: int, pp: int, microbatches: int) -> Scenario:
    job = {"tp": tp, "dp": dp, "pp": pp, "gpus_per_node": 8, "microbatches": microbatches,
           "microbatch_compute_s": 0.05, "dp_allreduce_bytes": 2e9, "pp_activation_bytes": 5e7,
           "link_gbps": 400, "nvlink_gbps": 3600, "dp_algorithm": "ring"}
    return parse_scenario({"job": job, "duration_s": 1e12, "seed": 1,
                           "noise": {"jitter_cv": 0.0, "gc_prob": 0.0}})


def reference_iteration(j: JobSpec) -> tuple[float, int]:
    """Per-event Python loops; healthy cluster, no noise. Returns (iteration time, records)."""
    g, link, nvl = j.gpus_per_node, j.link_gbps * 1e9 / 8, j.nvlink_gbps * 1e9 / 8

    def rank(t: int, d: int, s: int) -> int:
        return t + j.tp * (d + j.dp * s)

    def path(a: int, b: int) -> tuple[float, float]:
        same = a // g == b // g
        return (nvl, j.nvlink_latency_us * 1e-6) if same else (link, j.link_latency_us * 1e-6)

    def ring(members: list[int], nbytes: float) -> float:
        n = len(members)
        if n == 1:
            return 0.0
        edges = [path(members[i], members[(i + 1) % n]) for i in range(n)]
        bw, lat = min(e[0] for e in edges), max(e[1] for e in edges)
        return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat

    records: list[tuple[object, ...]] = []
    m = j.microbatches // j.dp
    last: dict[tuple[int, int], float] = {}
    for d in range(j.dp):
        tp_ar = [ring([rank(t, d, s) for t in range(j.tp)], j.tp_bytes) for s in range(j.pp)]
        xfer = []
        for s in range(j.pp - 1):
            bw, lat = path(rank(0, d, s), rank(0, d, s + 1))
            xfer.append(lat + j.pp_activation_bytes / bw)
        ops = [stage_ops(j.pp, m, s) for s in range(j.pp)]
        end: dict[tuple[int, bool, int], float] = {}
        pos, free = [0] * j.pp, [0.0] * j.pp
        while any(pos[s] < len(ops[s]) for s in range(j.pp)):
            for s in range(j.pp):
                while pos[s] < len(ops[s]):
                    fwd, i = ops[s][pos[s]]
                    src = (s - 1, True, i) if fwd else (s + 1, False, i)
                    needs = 0 <= src[0] < j.pp and not (not fwd and s == j.pp - 1)
                    if needs and src not in end:
                        break
                    x = xfer[min(s, src[0])] if needs else 0.0
                    start = max(free[s], end[src] if needs else 0.0) + x
                    if needs:
                        for t in range(j.tp):
                            records.append(("recv", rank(t, d, s), free[s], start))
                            records.append(("send", rank(t, d, src[0]), end[src], start))
                    frac = j.forward_fraction if fwd else 1 - j.forward_fraction
                    comp = j.microbatch_compute_s * frac
                    done = start + comp + tp_ar[s]
                    if j.tp > 1:
                        for t in range(j.tp):
                            records.append(("allreduce", rank(t, d, s), start + comp, done))
                    end[(s, fwd, i)] = free[s] = done
                    pos[s] += 1
        for s in range(j.pp):
            last[(s, d)] = free[s]
    finish = 0.0
    for s, t in itertools.product(range(j.pp), range(j.tp)):
        members = [rank(t, d, s) for d in range(j.dp)]
        start = max(last[(s, d)] for d in range(j.dp))
        exit_ = start + ring(members, j.dp_allreduce_bytes)
        for d in range(j.dp):
            records.append(("allreduce", rank(t, d, s), last[(s, d)], exit_))
        finish = max(finish, exit_ + j.optimizer_s)
    return finish, len(records)


def live_speed(scenario: Scenario, wall_budget_s: float = 45.0) -> tuple[float, float, int]:
    """(virtual s per wall s, virtual s reached, records written) through agent, NATS, tracker."""
    from greyhound.sim.live import LiveSimulation
    from services.common.settings import Settings
    from stack.up import Stack

    root = Path(tempfile.mkdtemp(prefix="gh-simbench-"))
    settings = Settings(data_dir=root / "data", shm_dir=Path("/dev/shm") / root.name)
    try:
        with Stack(settings, services=("tracker", "agent")) as stack:
            sim = LiveSimulation(scenario, Path(settings.shm_dir), "simbench")
            try:
                t0 = time.monotonic()
                p = sim.run(should_stop=lambda: time.monotonic() - t0 > wall_budget_s
                            or bool(stack.dead()))
                # Count until the agent has drained every ring, not just until we wrote them.
                while any(r.lag() for r in sim.rings) and not stack.dead():
                    time.sleep(0.05)
                assert not stack.dead(), f"services died: {stack.dead()}"
                return p.virtual_s / (time.monotonic() - t0), p.virtual_s, p.records
            finally:
                sim.close(remove=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(Path("/dev/shm") / root.name, ignore_errors=True)


def rate(fn: object, seconds: float = 2.0) -> float:
    assert callable(fn)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return n / (time.perf_counter() - t0)


def main() -> None:
    big, small = make(8, 64, 8, 512), make(8, 16, 2, 32)
    series = run_offline(big)
    ours_offline = rate(lambda: next(series))
    model = ClusterModel(big)
    clock = itertools.count()
    ours_events = rate(lambda: model.iteration(float(next(clock))))
    records_big = sum(len(b) for b in model.iteration(0.0).blocks)
    small_model = ClusterModel(small)
    ours_small = rate(lambda: small_model.iteration(0.0))
    ours_t = ClusterModel(small).iteration(0.0).duration_s
    ref_t, ref_records = reference_iteration(small.job)
    ref_small = rate(lambda: reference_iteration(small.job))
    small_records = sum(len(b) for b in ClusterModel(small).iteration(0.0).blocks)
    assert math.isclose(ours_t, ref_t, rel_tol=1e-9), (ours_t, ref_t)
    assert small_records == ref_records, (small_records, ref_records)
    rows = [
        ("ours, offline timings, 4,096 GPUs (TP8 DP64 PP8, m=8)", ours_offline, "-"),
        ("ours, with all NCCL records, 4,096 GPUs", ours_events, f"{records_big:,}"),
        ("ours, with all NCCL records, 256 GPUs (TP8 DP16 PP2)", ours_small, f"{small_records:,}"),
        ("reference per-event Python, 256 GPUs", ref_small, f"{ref_records:,}"),
    ]
    print(f"{'configuration':58} {'iterations/s':>13} {'records/iter':>13}")
    for name, r, n in rows:
        print(f"{name:58} {r:13.1f} {n:>13}")
    print(f"iteration time at 256 GPUs: ours {ours_t:.6f} s, reference {ref_t:.6f} s (agree)")
    live = make(8, 16, 2, 32)
    live = Scenario(live.name, live.job, 60.0, live.seed, live.faults, live.noise, live.costs)
    speed, reached, written = live_speed(live)
    print(f"live, 256 GPUs through agent + NATS + tracker: {speed:.2f}x real time "
          f"({reached:.1f} virtual s, {written:,} records)")
    print("RESULT " + json.dumps({
        "live_256_speed": round(speed, 2),
        "offline_4096_iters_per_s": round(ours_offline, 1),
        "events_4096_iters_per_s": round(ours_events, 1),
        "ours_256_iters_per_s": round(ours_small, 1),
        "reference_256_iters_per_s": round(ref_small, 1),
    }))


if __name__ == "__main__":
    main()
