"""S4: what a checkpoint-restart should replace, and what it would cost. A recommendation only.

Restarting is the one remedy that removes a fail-slow rather than working around it, and the
dearest: the job writes a checkpoint, stops, comes back on other parts, reads the checkpoint and
warms up again (a GPT2-100B checkpoint write alone takes ~100 min, longer than the mean fail-slow).
So the escalation policy reaches it last, and this module never restarts anything: it names the
parts to swap out and prices the restart, for an operator or a scheduler to act on.

What to replace, from a validated culprit: a slow GPU is replaced (with its node named as the
fallback where the scheduler cannot swap single GPUs); a congested link cannot be replaced by the
job, only left, so the job moves off one of its ends: the node that appears in the most slow links
(a faulty NIC or cable shows on every link of its node), ties going to the lowest id.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from greyhound.core.verdict import ValidationVerdict

Link = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Culprit:
    """Parts a validation named: slow GPUs and slow links (node pairs)."""

    gpus: tuple[int, ...] = ()
    links: tuple[Link, ...] = ()

    @classmethod
    def from_verdict(cls, verdict: ValidationVerdict) -> Culprit:
        if verdict.kind == "transient" or not (verdict.gpus or verdict.links):
            raise ValueError("the verdict names no part (transient): nothing to replace")
        return cls(tuple(sorted(set(verdict.gpus))),
                   tuple(sorted({(min(a, b), max(a, b)) for a, b in verdict.links})))


@dataclass(frozen=True, slots=True)
class RestartCosts:
    """Settings-like inputs: the checkpoint's total size and the storage's aggregate bandwidths,
    the fixed cost of a restart (scheduling, process start, NCCL init, warm-up) and the work
    since the last checkpoint that a restart without a fresh checkpoint would redo."""

    checkpoint_bytes: float
    write_bytes_per_s: float
    read_bytes_per_s: float
    restart_overhead_s: float
    save_first: bool = True
    work_since_checkpoint_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("checkpoint_bytes", "restart_overhead_s", "work_since_checkpoint_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("write_bytes_per_s", "read_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True, slots=True)
class RestartRecommendation:
    replace_gpus: tuple[int, ...]
    replace_nodes: tuple[int, ...]
    fallback_nodes: tuple[int, ...]  # the slow GPUs' nodes, where single GPUs cannot be swapped
    links: tuple[Link, ...]
    write_s: float
    read_s: float
    overhead_s: float
    redo_s: float
    summary: str

    @property
    def cost_s(self) -> float:
        return self.write_s + self.read_s + self.overhead_s + self.redo_s


def recommend_restart(culprit: Culprit, costs: RestartCosts, *, gpus_per_node: int) -> RestartRecommendation:
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    if not (culprit.gpus or culprit.links):
        raise ValueError("the culprit names no GPU and no link: nothing to replace")
    leave = _nodes_to_leave(culprit.links)
    fallback = tuple(sorted({g // gpus_per_node for g in culprit.gpus} - set(leave)))
    write = costs.checkpoint_bytes / costs.write_bytes_per_s if costs.save_first else 0.0
    redo = 0.0 if costs.save_first else costs.work_since_checkpoint_s
    read = costs.checkpoint_bytes / costs.read_bytes_per_s
    parts = [f"GPU {g} (node {g // gpus_per_node})" for g in culprit.gpus]
    parts += [f"node {n} (leaves slow link{'s' if len(ls) > 1 else ''} "
              f"{', '.join(f'{a}-{b}' for a, b in ls)})"
              for n, ls in ((n, [link for link in culprit.links if n in link]) for n in leave)]
    total = write + read + costs.restart_overhead_s + redo
    summary = (f"checkpoint-restart replacing {'; '.join(parts)}: about {total:.0f} s "
               f"(write {write:.0f} s, read {read:.0f} s, restart {costs.restart_overhead_s:.0f} s"
               + (f", redo {redo:.0f} s" if redo else "") + ")")
    return RestartRecommendation(
        replace_gpus=culprit.gpus, replace_nodes=leave, fallback_nodes=fallback, links=culprit.links,
        write_s=write, read_s=read, overhead_s=costs.restart_overhead_s, redo_s=redo, summary=summary,
    )


def _nodes_to_leave(links: Sequence[Link]) -> tuple[int, ...]:
    """Greedy cover: the node on the most still-uncovered slow links, until every link has an end."""
    left: list[Link] = list(links)
    out: list[int] = []
    while left:
        counts = Counter(n for link in left for n in link)
        node = min(counts, key=lambda n: (-counts[n], n))
        out.append(node)
        left = [link for link in left if node not in link]
    return tuple(sorted(out))
