"""``greyhound demo`` (``make demo``): GREYHOUND's end-to-end experiment, with and without it.

The paper's job (PAPERS.md, results): a GPT-style model on 256 GPUs, TP8 DP16 PP2, 12 fail-slows
hidden from the system (2 link congestions, 10 compute slowdowns of mixed severity, some
overlapping). ``scenarios/paper-256.yaml`` holds the schedule, the layout and the costs; any
scenario can be played instead (``--scenario FILE.yaml``). The same schedule and seed run three
ways:

* healthy: the scenario without its faults (offline: the simulator's model alone);
* without Greyhound's mitigation: the faults, no plan followed (offline);
* with it: live through every real layer on the embedded defaults (stack.paper_run), the job
  following its plans, S2 applied automatically, S3 approved by a scripted operator over REST.

It prints a progress line while the live run goes, then a table (faults found with kind and
culprit, reaction times, throughput of the three runs, the speed-up) beside the paper's
numbers, writes the chart (stack.paper_chart) and ends with ``RESULT {json}``. The exit status
is 0 when the live run completed and the services kept up with it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from greyhound.sim.live import LiveProgress
from greyhound.sim.pace import PacePolicy
from greyhound.sim.scenario import Scenario, ScenarioError, load_scenario
from greyhound.sim.score import Found
from greyhound.sim.throughput import offline_iterations, per_minute
from services.common.settings import Settings
from services.planner.settings import PlannerSettings
from stack.paper_run import WithResult, play_with
from stack.sim_plans import Step
from stack.up import Stack, wait_api

SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "paper-256.yaml"
PAPER = {"injected": 12, "detected": 12, "correct": 12, "mean_detect_s": 3.7,
         "mean_localize_s": 10.56, "throughput_healthy": 37.4, "throughput_without": 18.9,
         "throughput_with": 29.8, "speedup": 1.58}
RECHECK_S = 10.0  # the planner's re-check of a mitigated GPU (its default: 300 s)
# Real time for at most this long after an onset. An S3 for a 10x congestion is proposed when
# its loss reaches the S3 cost, ~50 virtual s in, and reaches the job a few wall seconds later:
# a 60 s window closed on it in one run, and at 8x those seconds made its S3 come at 70 s.
REACTION_WINDOW_S = 90.0
SEVERITY = ((1.75, "weak"), (2.5, "medium"), (float("inf"), "strong"))


def severity(factor: float) -> str:
    return next(name for top, name in SEVERITY if factor < top)


class Bar:
    """One progress line: virtual time, faults named so far, strategies in force, the pace."""

    def __init__(self, out: TextIO, sc: Scenario) -> None:
        self.out, self.sc = out, sc
        self.tty = out.isatty()
        self.next = 0.0

    def __call__(self, p: LiveProgress, mode: str, found: list[Found], steps: list[Step]) -> None:
        now = time.monotonic()
        if now < self.next:
            return
        self.next = now + (0.5 if self.tty else 15.0)
        d = self.sc.duration_s
        width = 30
        done = min(1.0, p.virtual_s / d)
        bar = "#" * int(done * width) + "-" * (width - int(done * width))
        named = sum(f.correct for f in found)
        started = sum(f.start_s <= p.virtual_s for f in self.sc.faults)
        line = (f"  [{bar}] {p.virtual_s:6.0f}/{d:.0f} s virtual  faults named {named}/{started} "
                f"of {len(self.sc.faults)}  in force: {in_force(steps) or '-'}  pace "
                f"{mode} {p.speed:4.1f}x avg")
        if self.tty:
            print("\r" + line.ljust(120), end="", file=self.out, flush=True)
        else:
            print(line, file=self.out, flush=True)

    def end(self) -> None:
        if self.tty:
            print(file=self.out, flush=True)


def in_force(steps: list[Step]) -> str:
    live: dict[str | None, str] = {}
    for s in steps:
        if s.error:
            continue
        if s.action == "apply":
            live[s.plan_id] = str(s.strategy)
        else:
            live.pop(s.plan_id, None)
    return ",".join(sorted(live.values()))


def _mean(xs: list[float]) -> float | None:
    return round(statistics.fmean(xs), 2) if xs else None


def summarize(sc: Scenario, res: WithResult, healthy: float, without: float,
              wall_s: float, chart: str | None) -> dict[str, Any]:
    with_ = per_minute(res.iterations, sc.duration_s)
    found = res.found
    right = [f for f in found if f.correct]
    return {
        "scenario": sc.name, "gpus": sc.job.world, "injected": len(sc.faults),
        "detected": sum(f.culprit_ok for f in found),  # named where, whatever the kind
        "correct": len(right),
        "throughput_healthy": round(healthy, 2), "throughput_without": round(without, 2),
        "throughput_with": round(with_, 2),
        "speedup": round(with_ / without, 3) if without > 0 else None,
        "mean_detect_s": _mean([f.detect_s for f in right if f.detect_s is not None]),
        "mean_localize_s": _mean([f.localize_s for f in right if f.localize_s is not None]),
        "mean_validate_s": _mean([f.validate_s for f in right if f.validate_s is not None]),
        "chart": chart, "wall_s": round(wall_s, 1),
        "with_wall_s": round(res.wall_s, 1), "followed": res.followed,
        "pace": res.pace.describe(),
        "plans": [{"strategy": s.strategy, "action": s.action, "virtual_s": round(s.virtual_s, 1),
                   "cost_s": round(s.cost_s, 2), "error": s.error} for s in res.steps],
        "approved_by_operator": len(res.approved),
        "faults": [{"kind": sc.faults[f.fault].kind, "found": f.kind, "correct": f.correct,
                    "detect_s": _r(f.detect_s), "localize_s": _r(f.localize_s),
                    "validate_s": _r(f.validate_s)} for f in found],
    }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _target(sc: Scenario, f: Any) -> str:
    if f.kind == "link_congestion":
        return f"link {f.nodes[0]}-{f.nodes[1]} x{f.factor:g}"
    if f.kind == "cpu_contention":
        return f"node {f.node} CPUs x{f.factor:g} ({severity(f.factor)})"
    return f"GPU {f.rank} x{f.factor:g} ({severity(f.factor)})"


def print_table(sc: Scenario, res: WithResult, summary: dict[str, Any], out: TextIO) -> None:
    print(f"\n  {'#':>2} {'fail-slow':28} {'from':>6} {'to':>6}  {'found as':14} {'right':5} "
          f"{'detect':>7} {'named':>7} {'valid.':>7}", file=out)
    for f in res.found:
        spec = sc.faults[f.fault]
        cells = [f"{x:6.1f}s" if x is not None else "      -" for x in
                 (f.detect_s, f.localize_s, f.validate_s)]
        print(f"  {f.fault + 1:2d} {_target(sc, spec):28} {spec.start_s:6.0f} "
              f"{min(spec.end_s, sc.duration_s):6.0f}  {(f.kind or '-'):14} "
              f"{'yes' if f.correct else 'NO':5} {' '.join(cells)}", file=out)
    steps = ", ".join(f"{s.strategy} {'on' if s.action == 'apply' else 'off'} "
                      f"@{s.virtual_s:.0f}s" for s in res.steps if not s.error)
    print(f"  plans followed (virtual s): {steps or 'none'}", file=out)
    s, p = summary, PAPER
    rows = [
        ("fail-slows injected", p["injected"], s["injected"], ""),
        ("detected", p["detected"], s["detected"], ""),
        ("kind and culprit right", p["correct"], s["correct"], ""),
        ("mean s, onset to detection", p["mean_detect_s"], s["mean_detect_s"], "virtual s"),
        ("mean s, onset to root cause", p["mean_localize_s"], s["mean_localize_s"],
         f"named by the analyzer; validated at {s['mean_validate_s']} s"),
        ("throughput healthy", p["throughput_healthy"], s["throughput_healthy"], "it/min"),
        ("throughput without Greyhound", p["throughput_without"], s["throughput_without"],
         "it/min"),
        ("throughput with Greyhound", p["throughput_with"], s["throughput_with"], "it/min"),
        ("speed-up (with / without)", p["speedup"], s["speedup"], ""),
    ]
    print(f"\n  {'':32} {'paper (256 H800)':>17} {'this run':>10}", file=out)
    for name, paper, ours, note in rows:
        print(f"  {name:32} {paper!s:>17} {'-' if ours is None else ours!s:>10}  {note}", file=out)
    print(f"  paced: {s['pace']}", file=out)


def planner_costs(sc: Scenario, planner: PlannerSettings, out: TextIO) -> PlannerSettings:
    """The planner's starting cost estimates of S2 and S3 set to what the scenario says they
    cost this job (an operator configures them for the cluster; the planner's defaults are
    generic guesses, 5 s and 60 s, that its escalation weighs the slowdown's loss against).
    One the environment sets is kept."""
    update = {}
    for field, cost in (("s2_overhead_s", sc.costs.microbatch_s),
                        ("s3_overhead_s", sc.costs.reconfigure_s)):
        if f"GREYHOUND_PLANNER_{field.upper()}" not in os.environ:
            update[field] = cost
    if update:
        print("        the planner's cost estimates are the scenario's: " + ", ".join(
            f"{k.split('_')[0].upper()} {v:g} s" for k, v in update.items()), file=out,
            flush=True)
    return planner.model_copy(update=update)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def run_paper_demo(settings: Settings, *, scenario: Path | None = None, port: int,
                   chart: Path | None = None, fast: float = 8.0,
                   out: TextIO | None = None) -> int:
    out = out or sys.stdout
    t0 = time.monotonic()
    if threading.current_thread() is threading.main_thread():
        # a TERM (timeout, a supervisor) unwinds like Ctrl-C, so the services and the embedded
        # servers stop with the demo instead of running on without it
        signal.signal(signal.SIGTERM, _interrupt)
    # the progress line shows what the follower and the stack would log line by line
    for chatty in ("stack.sim_plans", "stack.up"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
    path = scenario or SCENARIO
    try:
        sc = load_scenario(path)
    except (OSError, ScenarioError) as exc:
        raise SystemExit(f"greyhound demo: {path}: {exc}") from None
    if not sc.faults:
        raise SystemExit(f"greyhound demo: {path}: the scenario injects no fault")
    j = sc.job
    kinds = {k: sum(f.kind == k for f in sc.faults) for k in {f.kind for f in sc.faults}}
    print(f"greyhound demo: {sc.name}, {j.world} GPUs (TP{j.tp} DP{j.dp} PP{j.pp}), "
          f"{sc.duration_s:g} virtual s, {len(sc.faults)} fail-slows hidden from the services "
          f"({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))})", file=out, flush=True)
    print("  [1/4] healthy and without mitigation: the simulator's model offline ...", file=out,
          flush=True)
    healthy_its = offline_iterations(sc, faults=False)
    without_its = offline_iterations(sc)
    healthy, without = per_minute(healthy_its, sc.duration_s), per_minute(without_its,
                                                                        sc.duration_s)
    print(f"        healthy {healthy:.1f} it/min, without Greyhound {without:.1f} it/min",
          file=out, flush=True)
    print(f"  [2/4] starting embedded NATS + Postgres and every service (data and logs in "
          f"{settings.data_dir}) ...", file=out, flush=True)
    policy = PacePolicy(fast=fast, window_s=REACTION_WINDOW_S)
    planner = PlannerSettings()
    if "GREYHOUND_PLANNER_RECHECK_S" not in os.environ:
        print(f"        the planner re-checks a GPU under an S2 plan every {RECHECK_S:g} s "
              f"instead of {planner.recheck_s:g} s (the faults here last minutes, not tens of "
              f"minutes); every other setting is the default", file=out, flush=True)
        planner = planner.model_copy(update={"recheck_s": RECHECK_S})
    planner = planner_costs(sc, planner, out)
    with Stack(settings, port=port, service_settings=(planner,)) as stack:
        wait_api(f"http://127.0.0.1:{port}")
        print(f"  [3/4] with Greyhound, live: the simulated job follows its plans; S2 automatic, "
              f"S3 approved by a scripted operator over REST; pace 1x around each onset and "
              f"while the services profile or pause the job, up to {fast:g}x otherwise",
              file=out, flush=True)
        bar = Bar(out, sc)
        try:
            res = play_with(stack, sc, policy, on_progress=bar)
        except (RuntimeError, TimeoutError) as exc:
            bar.end()
            print(f"  FAILED: {exc}", file=out, flush=True)
            return 1
        bar.end()
    chart_path: str | None = None
    target = chart or Path(settings.data_dir) / "demo" / f"{sc.name}.png"
    try:
        from stack.paper_chart import ChartUnavailable, Mark, draw

        marks = [Mark(s.virtual_s, str(s.strategy), s.action) for s in res.steps if not s.error]
        chart_path = str(draw(target, sc, healthy=healthy_its, without=without_its,
                              with_=res.iterations, marks=marks))
    except ChartUnavailable as exc:
        print(f"  no chart: {exc}", file=out)
    summary = summarize(sc, res, healthy, without, time.monotonic() - t0, chart_path)
    print("  [4/4] results", file=out)
    print_table(sc, res, summary, out)
    if not res.followed:
        print(f"  WARNING: the services had not read all the telemetry when the run ended "
              f"(tracker backlog {res.backlog}): the numbers above under-count what they find",
              file=out)
    if chart_path:
        print(f"  chart: {chart_path}", file=out)
    summary["wall_s"] = round(time.monotonic() - t0, 1)
    print(f"  wall time {summary['wall_s']:.0f} s", file=out)
    print("RESULT " + json.dumps(summary), file=out, flush=True)
    return 0 if res.followed else 1
