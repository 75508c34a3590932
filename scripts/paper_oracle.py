"""The ceiling of the demo's "with Greyhound" throughput: the simulator's model alone, an oracle
that knows the fault schedule applies each mitigation ``--delay`` virtual seconds after a fault's
onset and takes it back ``--late`` seconds after its end, paying the scenario's costs.

S2: the planner's exact min-max micro-batch allocation (greyhound.core.microbatch) over every
slow GPU's DP group. S3: the planner's own role swap (greyhound.core.role_swap) for each
congested link, so that the link carries pipeline instead of DP traffic (6<->21 for link 5-6,
12<->27 for link 27-28, as the demo's runs proposed).

    .venv/bin/python scripts/paper_oracle.py scenarios/paper-256.yaml --delay 0
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from greyhound.core.layout import ParallelShape
from greyhound.core.microbatch import allocate_microbatches
from greyhound.core.plans import MicrobatchPlan, SwapNodesPlan, even_split
from greyhound.core.role_swap import Traffic, plan_role_swap
from greyhound.sim.model import ClusterModel
from greyhound.sim.scenario import Scenario, load_scenario
from greyhound.sim.throughput import offline_iterations, per_minute


def oracle_iterations(sc: Scenario, *, delay_s: float, late_s: float, s3: bool = True,
                      s3_delay_s: float | None = None,
                      s3_late_s: float | None = None) -> list[tuple[float, float]]:
    j = sc.job
    model = ClusterModel(sc)
    traffic = Traffic(j.dp_allreduce_bytes, j.pp_activation_bytes, max(1, j.microbatches // j.dp))

    def role_swap(link: tuple[int, int], factor: float) -> tuple[tuple[int, int], ...]:
        return plan_role_swap(ParallelShape(j.tp, j.dp, j.pp), j.gpus_per_node,
                              {link: factor}, traffic).node_pairs

    counts: tuple[int, ...] = even_split(j.microbatches, j.dp)
    swaps: tuple[tuple[int, int], ...] = ()
    out: list[tuple[float, float]] = []
    t = 0.0
    while t < sc.duration_s:
        times = np.ones(j.dp)
        want: list[tuple[int, int]] = []
        for f in sc.faults:
            link = f.kind == "link_congestion"
            d = s3_delay_s if link and s3_delay_s is not None else delay_s
            late = s3_late_s if link and s3_late_s is not None else late_s
            end = f.start_s + (f.duration_s if f.duration_s is not None else float("inf"))
            if not f.start_s + d <= t < end + late:
                continue
            if f.kind == "gpu_slow" and f.rank is not None:
                g = (f.rank // j.tp) % j.dp
                times[g] = max(times[g], f.factor)
            elif f.kind == "link_congestion" and f.nodes is not None and s3:
                want.extend(role_swap(f.nodes, f.factor))
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
    ap.add_argument("--s3-late", type=float, default=None,
                    help="for link congestions (inf: an S3 kept, as the planner keeps one whose "
                    "congestion's end it cannot see under the swap)")
    ap.add_argument("--no-s3", action="store_true")
    a = ap.parse_args()
    sc = load_scenario(a.scenario)
    healthy = per_minute(offline_iterations(sc, faults=False), sc.duration_s)
    without = per_minute(offline_iterations(sc), sc.duration_s)
    with_ = per_minute(oracle_iterations(sc, delay_s=a.delay, late_s=a.late, s3=not a.no_s3,
                                         s3_delay_s=a.s3_delay, s3_late_s=a.s3_late),
                        sc.duration_s)
    print(f"{sc.name}: healthy {healthy:.2f}, without {without:.2f}, oracle with {with_:.2f} "
          f"it/min, speed-up {with_ / without:.3f}")


if __name__ == "__main__":
    main()
