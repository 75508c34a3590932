"""GREYHOUND's mitigation measurements (PAPERS.md, results), reproduced within 10%.

Testbeds, as we represent them:
- S2: one 8-GPU node (NVLink only), TP1 DP4 PP2, M = 64 micro-batches of 45 ms, 2 GB of
  gradients per GPU; "medium" slowdown = one GPU of DP group 0 at 1.85x (stage 1).
- Fig. 15: 16 GPUs, TP1 DP4 PP4, each GPU with its own 400 Gbit/s NIC (gpus_per_node = 1, so a
  "link" is a GPU pair), M = 16 micro-batches of 100 ms, 2 GB of gradients and 300 MB of
  activations per micro-batch; "strong" congestion divides a link's bandwidth by 10.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from greyhound.core.plans import MicrobatchPlan, SwapGpusPlan
from tests.sim.helpers import iteration_s, job

S2_JOB = job(dp=4, pp=2, gpus_per_node=8, microbatches=64, microbatch_compute_s=0.045,
             dp_allreduce_bytes=2e9, pp_activation_bytes=6e7, optimizer_s=0.01,
             link_latency_us=5.0, nvlink_latency_us=1.0, host_fraction=0.1)
FIG15_JOB = job(dp=4, pp=4, gpus_per_node=1, microbatches=16, microbatch_compute_s=0.1,
                dp_allreduce_bytes=2e9, pp_activation_bytes=3e8, optimizer_s=0.01,
                link_latency_us=5.0, nvlink_latency_us=1.0)


def within(value: float, paper: float) -> bool:
    return abs(value - paper) <= 0.10 * paper


def s2_counts(total: int, per_microbatch: list[float], multiple: int) -> tuple[int, ...]:
    """The paper's S2 problem, min max_i m_i t_i with m_i = 0 (mod PP), solved exhaustively."""
    options = range(multiple, total, multiple)
    best = min(
        (c for c in itertools.product(options, repeat=len(per_microbatch)) if sum(c) == total),
        key=lambda c: max(m * t for m, t in zip(c, per_microbatch, strict=True)),
    )
    return tuple(best)


def test_s2_dp4_one_medium_slow_group_131_to_083() -> None:
    slow = [{"kind": "gpu_slow", "rank": 4, "start_s": 0, "factor": 1.85}]
    before = iteration_s(S2_JOB, slow)
    counts = s2_counts(64, [1.85, 1.0, 1.0, 1.0], multiple=2)
    after = iteration_s(S2_JOB, slow, MicrobatchPlan(counts))
    assert within(before, 1.31), before
    assert within(after, 0.83), after
    assert within(before / after, 1.31 / 0.83)


def links(*pairs: tuple[int, int]) -> list[dict[str, Any]]:
    return [{"kind": "link_congestion", "nodes": list(p), "start_s": 0, "factor": 10.0}
            for p in pairs]


@pytest.mark.parametrize(
    ("congested", "paper_before"),
    [(((1, 2),), 1.6), (((1, 2), (5, 6)), 1.7)],
    ids=["one-link", "two-links"],
)
def test_fig15_one_or_two_congested_links_moved_to_pp_160_170_to_130(
    congested: tuple[tuple[int, int], ...], paper_before: float
) -> None:
    """Congested DP ring edges (stages 0 and 1) become PP edges between inner stages 1 and 2."""
    healthy = iteration_s(FIG15_JOB)
    before = iteration_s(FIG15_JOB, links(*congested)) / healthy
    # GPU g starts as rank g = dp + 4 * pp; each link's GPUs go to stages 1 and 2 of one pipeline.
    swaps = [((1, 5), (2, 9)), ((1, 4), (2, 8), (5, 9), (6, 13))][len(congested) - 1]
    after = iteration_s(FIG15_JOB, links(*congested), SwapGpusPlan(swaps)) / healthy
    assert within(before, paper_before), before
    assert within(after, 1.3), after


def test_fig15_three_links_touching_six_gpus_190_to_170() -> None:
    """One DP edge and two PP edges; the DP edge's GPUs consolidated into inner stage 2's ring."""
    congested = links((1, 2), (6, 10), (8, 12))
    healthy = iteration_s(FIG15_JOB)
    before = iteration_s(FIG15_JOB, congested) / healthy
    after = iteration_s(FIG15_JOB, congested, SwapGpusPlan(((1, 9), (2, 10)))) / healthy
    assert within(before, 1.9), before
    assert within(after, 1.7), after
