"""The ceiling of the demo's "with Greyhound" throughput: the simulator's model alone, an oracle
that knows the fault schedule applies each mitigation ``--delay`` virtual seconds after a fault's
onset and takes it back ``--late`` seconds after its end, paying the scenario's costs.

S2: the planner's exact min-max micro-batch allocation (greyhound.core.microbatch) over every
slow GPU's DP group. S3: for each congested link (a, b), node b exchanges roles with the node at
the same place in the other pipeline stage (node b +- nodes/2), so the link carries pipeline
instead of DP traffic (what the planner proposed in the demo's runs: 6<->21 for link 5-6).

    .venv/bin/python scripts/paper_oracle.py scenarios/paper-256.yaml --delay 0
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from greyhound.core.microbatch import allocate_microbatches
from greyhound.core.plans import MicrobatchPlan, SwapNodesPlan, even_split
from greyhound.sim.model import ClusterModel
from greyhound.sim.scenario import Scenario, load_scenario
from greyhound.sim.throughput import offline_iterations, per_minute


def oracle_iterations(sc: Scenario, *, delay_s: float, late_s: float, s3: bool = True,
                      s3_delay_s: float | None = None) -> list[tuple[float, float]]:
    j = sc.job
    half = j.nodes // 2
    model = ClusterModel(sc)
    counts: tuple[int, ...] = even_split(j.microbatches, j.dp)
    swaps: tuple[tuple[int, int], ...] = ()
    out: list[tuple[float, float]] = []
    t = 0.0
    while t < sc.duration_s:
        times = np.ones(j.dp)
        want: list[tuple[int, int]] = []
        for f in sc.faults:
            d = s3_delay_s if f.kind == "link_congestion" and s3_delay_s is not None else delay_s
            end = f.start_s + (f.duration_s if f.duration_s is not None else float("inf"))
            if not f.start_s + d <= t < end + late_s:
                continue
            if f.kind == "gpu_slow" and f.rank is not None:
                g = (f.rank // j.tp) % j.dp
                times[g] = max(times[g], f.factor)
            elif f.kind == "link_congestion" and f.nodes is not None and s3:
                b = max(f.nodes)
                want.append((b, b + half if b < half else b - half))
        new = (allocate_microbatches(times, j.microbatches).counts if (times > 1).any()
               else even_split(j.microbatches, j.dp))
        cost = 0.0
        if tuple(new) != counts:
            cost += model.apply_plan(MicrobatchPlan(tuple(new)))
            counts = tuple(new)
        if tuple(want) != swaps:
            if swaps:  # a swap undoes itself
                cost += model.apply_plan(SwapNodesPlan(swaps))
            if want:
                cost += model.apply_plan(SwapNodesPlan(tuple(want)))
            swaps = tuple(want)
        t += cost
        it = model.iteration(t, events=False)
        out.append((t, it.duration_s))
        t = it.end_s
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenario", type=Path)
    ap.add_argument("--delay", type=float, default=0.0, help="virtual s after each onset")
    ap.add_argument("--late", type=float, default=0.0, help="virtual s after each end")
    ap.add_argument("--s3-delay", type=float, default=None, help="for link congestions")
    ap.add_argument("--no-s3", action="store_true")
    a = ap.parse_args()
    sc = load_scenario(a.scenario)
    healthy = per_minute(offline_iterations(sc, faults=False), sc.duration_s)
    without = per_minute(offline_iterations(sc), sc.duration_s)
    with_ = per_minute(oracle_iterations(sc, delay_s=a.delay, late_s=a.late, s3=not a.no_s3,
                                         s3_delay_s=a.s3_delay), sc.duration_s)
    print(f"{sc.name}: healthy {healthy:.2f}, without {without:.2f}, oracle with {with_:.2f} "
          f"it/min, speed-up {with_ / without:.3f}")


if __name__ == "__main__":
    main()
