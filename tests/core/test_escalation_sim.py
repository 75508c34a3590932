"""The escalation policy driving the simulator: a compute straggler re-balanced once the loss pays
for S2, the plan reverted when the fault ends, less time lost than ignoring it."""

from __future__ import annotations

import numpy as np

from greyhound.core.escalation import Apply, Escalation, Revert, Strategy
from greyhound.core.microbatch import allocate_microbatches
from greyhound.core.plans import MicrobatchPlan, even_split
from greyhound.sim.model import ClusterModel
from tests.sim.helpers import job, scenario

JOB = job(dp=4, pp=1, gpus_per_node=4, microbatches=32, microbatch_compute_s=0.05,
          dp_allreduce_bytes=1e8, optimizer_s=0.01)
FAULT = [{"kind": "gpu_slow", "rank": 2, "start_s": 20.0, "duration_s": 200.0, "factor": 1.8}]
OVERHEADS = {Strategy.MICROBATCH: 0.5, Strategy.TOPOLOGY: 60.0, Strategy.RESTART: 1800.0}
END_S = 300.0


def run(policy: bool) -> tuple[float, list[tuple[float, object]], list[float]]:
    """Virtual seconds to run 300 s worth of healthy iterations, the decisions, iteration times."""
    model = ClusterModel(scenario(JOB, FAULT, duration_s=1e6))
    healthy = model.iteration(0.0, events=False).duration_s
    target = int(END_S / healthy)
    now, done, fault_end = 0.0, 0, FAULT[0]["start_s"] + FAULT[0]["duration_s"]
    esc: Escalation | None = None
    decisions: list[tuple[float, object]] = []
    times: list[float] = []
    while done < target:
        t = model.iteration(now, events=False).duration_s
        now, done = now + t, done + 1
        times.append(t)
        if not policy:
            continue
        if esc is None and t > 1.1 * healthy:  # the tracker's change point opens an incident
            esc = Escalation("compute", healthy, OVERHEADS)
        if esc is None or esc.closed:
            continue
        decision = esc.observe(t) if now < fault_end else esc.recovered()
        if isinstance(decision, Apply) and decision.strategy is Strategy.MICROBATCH:
            pace = model.derived(now).comp.max(axis=(0, 2))  # the analyzer's per-group profile
            plan = allocate_microbatches(pace, JOB["microbatches"])
            now += model.apply_plan(MicrobatchPlan(plan.counts))
            esc.applied(Strategy.MICROBATCH, model.scenario.costs.microbatch_s)
        elif isinstance(decision, Revert):
            now += model.apply_plan(MicrobatchPlan(even_split(JOB["microbatches"], JOB["dp"])))
        if decision is not None:
            decisions.append((now, decision))
    return now, decisions, times


def test_s2_applied_once_it_pays_then_reverted_and_time_saved() -> None:
    ignored, _, slow_times = run(policy=False)
    handled, decisions, times = run(policy=True)
    kinds = [(type(d).__name__, d.strategy) for _, d in decisions]  # type: ignore[attr-defined]
    assert kinds == [("Apply", Strategy.MICROBATCH), ("Revert", Strategy.MICROBATCH)]
    (applied_at, apply), (reverted_at, _) = decisions
    assert isinstance(apply, Apply) and apply.loss_s >= OVERHEADS[Strategy.MICROBATCH]
    assert 20.0 < applied_at < 25.0 and reverted_at >= 220.0
    healthy, slow = min(times), max(slow_times)
    under_s2 = np.array([t for at, t in zip(np.cumsum(times), times, strict=True)
                         if applied_at < at < reverted_at])
    # One straggler at 1.72x (host work is not slowed) takes 10% of the job's capacity, which no
    # split wins back, so S2 is not within the 10% tolerance and its loss keeps counting; it
    # removes most of the slowdown and never accrues S3's 60 s of loss in the fault's 200 s.
    assert under_s2.mean() < healthy + 0.3 * (slow - healthy)
    print(f"\nsimulated 300 s job, one GPU at 1.8x for 200 s: ignored {ignored:.1f} s, "
          f"with escalation {handled:.1f} s (S2 at {applied_at:.1f} s, reverted at {reverted_at:.1f} s); "
          f"iteration healthy {healthy:.3f} s, slow {slow:.3f} s, under S2 {under_s2.mean():.3f} s")
    assert handled < ignored - 0.5 * (ignored - END_S)
