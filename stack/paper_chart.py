"""The paper demo's chart, drawn like GREYHOUND's Fig. 20: training throughput over time, with
and without Greyhound's mitigation (and the healthy job), each fault shaded, each strategy's start
and revert marked.

matplotlib is an optional extra (``pip install -e '.[demo]'``, which ``make demo`` does); only
this module imports it, and only when a chart is asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from greyhound.sim.scenario import Scenario
from greyhound.sim.throughput import Iterations, over_time


class ChartUnavailable(RuntimeError):
    """matplotlib is not installed."""


@dataclass(frozen=True, slots=True)
class Mark:
    virtual_s: float
    strategy: str
    action: str  # apply | revert


def draw(path: Path, sc: Scenario, *, healthy: Iterations, without: Iterations,
         with_: Iterations, marks: Sequence[Mark], bin_s: float = 30.0) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ChartUnavailable("the chart needs matplotlib: pip install -e '.[demo]'") from exc
    d = sc.duration_s
    fig, ax = plt.subplots(figsize=(11, 4.6), dpi=110)
    for f in sc.faults:
        end = min(f.end_s, d)
        color = "#f4a582" if f.kind == "link_congestion" else "#bababa"
        ax.axvspan(f.start_s / 60, end / 60, color=color, alpha=0.35, lw=0)
    lines: list[tuple[Iterations, str, dict[str, Any]]] = [
        (healthy, "healthy", {"color": "#4d4d4d", "ls": ":", "lw": 1.2}),
        (without, "without Greyhound", {"color": "#d6604d", "lw": 1.4}),
        (with_, "with Greyhound", {"color": "#2166ac", "lw": 1.8})]
    for series, label, style in lines:
        x, y = over_time(series, d, bin_s)
        ax.plot(x / 60, y, label=label, **style)
    top = ax.get_ylim()[1]
    colors = {"S2": "#1b7837", "S3": "#762a83", "S4": "#8c510a"}
    for m in marks:
        ax.axvline(m.virtual_s / 60, color=colors.get(m.strategy, "k"),
                   ls="-" if m.action == "apply" else "--", lw=0.9, alpha=0.8)
        ax.text(m.virtual_s / 60, top * 0.98, f"{m.strategy}{'' if m.action == 'apply' else ' off'}",
                rotation=90, va="top", ha="right", fontsize=7, color=colors.get(m.strategy, "k"))
    from matplotlib.patches import Patch

    handles, _ = ax.get_legend_handles_labels()
    handles += [Patch(color="#bababa", alpha=0.35, label="compute fail-slow"),
                Patch(color="#f4a582", alpha=0.35, label="link congestion")]
    ax.legend(handles=handles, loc="lower left", fontsize=8, ncol=5)
    ax.set_xlim(0, d / 60)
    ax.set_ylim(0, top)
    ax.set_xlabel("time (virtual minutes)")
    ax.set_ylabel(f"iterations per minute ({bin_s:g} s windows)")
    ax.set_title(f"{sc.name}: {sc.job.world} GPUs (TP{sc.job.tp} DP{sc.job.dp} PP{sc.job.pp}), "
                 f"{len(sc.faults)} fail-slows; S2/S3 lines: plan applied, dashed: reverted",
                 fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
