"""S3 (a): hand a congested link from data-parallel to pipeline-parallel traffic (GREYHOUND Fig. 11).

Per iteration a DP ring edge carries 2 (n - 1) / n times the gradients (tens of GB at scale) while
a PP edge carries one activation per micro-batch each way (tens to hundreds of MB), so the same
congested link costs far less under PP. Exchanging the roles of two nodes (every GPU of one takes
the ranks of the other's GPU at the same position) moves the link from one role to the other:
with PP2 x DP2 over nodes 0-3 (stage 0 on nodes 0 and 1), link 2-3 carries stage 1's DP ring;
swapping nodes 1 and 2 makes 2-3 the PP edge of DP group 1 (the paper's "link 3-4, swap 2 and 3",
counted from 1).

Candidates are exactly such role swaps: one end of a congested link exchanged with another node
so that the link afterwards carries PP traffic and no DP traffic. A swap that takes every group
off the node pair is not proposed: the validator measured this pair, not the pairs such a swap
would load instead, and in a spine-leaf fabric those can cross the same congested spine path.
Each candidate is scored by the bytes it leaves on congested links, weighted by each link's
slowdown (``(factor - 1) x bytes`` in the busier direction); the lowest wins, ties going to the
closest pair of node ids (nodes numbered along racks share switches), then the lowest. Several
congested links are handled one swap at a time while the score drops.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from greyhound.core.arrays import IntArray
from greyhound.core.layout import ParallelShape, checked_layout, swaps_between

Link = tuple[int, int]


@dataclass(frozen=True, slots=True)
class LinkLoad:
    dp_bytes: float  # per iteration, busier direction
    pp_bytes: float


@dataclass(frozen=True, slots=True)
class RoleSwapPlan:
    """``node_pairs``: nodes that exchange roles, in order; ``swaps``: the same as GPU pairs.
    Scores are congestion-weighted bytes per iteration (lower is better)."""

    node_pairs: tuple[Link, ...]
    swaps: tuple[tuple[int, int], ...]
    gpu_of_rank: tuple[int, ...]
    before: dict[Link, LinkLoad]
    after: dict[Link, LinkLoad]
    score_before: float
    score_after: float


@dataclass(frozen=True, slots=True)
class Traffic:
    """Bytes per iteration each group moves: a DP all-reduce's gradients, one activation."""

    gradient_bytes: float
    activation_bytes: float
    microbatches: int


def link_loads(
    shape: ParallelShape, gpus_per_node: int, layout: IntArray, traffic: Traffic, links: Sequence[Link]
) -> dict[Link, LinkLoad]:
    """DP and PP bytes per iteration over each node pair in ``links`` (busier direction)."""
    grid = layout.reshape(shape.pp, shape.dp, shape.tp) // gpus_per_node  # node of each rank
    per_edge_dp = 2.0 * (shape.dp - 1) / shape.dp * traffic.gradient_bytes if shape.dp > 1 else 0.0
    per_edge_pp = traffic.microbatches * traffic.activation_bytes
    dp_src, dp_dst = grid, np.roll(grid, -1, axis=1)
    pp_src, pp_dst = grid[:-1], grid[1:]
    out: dict[Link, LinkLoad] = {}
    for a, b in links:
        dp_ab = np.count_nonzero((dp_src == a) & (dp_dst == b)) if shape.dp > 1 else 0
        dp_ba = np.count_nonzero((dp_src == b) & (dp_dst == a)) if shape.dp > 1 else 0
        # Activations go forward and gradients of activations come back: both directions alike.
        pp_n = np.count_nonzero(((pp_src == a) & (pp_dst == b)) | ((pp_src == b) & (pp_dst == a)))
        out[(a, b)] = LinkLoad(float(max(dp_ab, dp_ba) * per_edge_dp), float(pp_n * per_edge_pp))
    return out


def plan_role_swap(
    shape: ParallelShape,
    gpus_per_node: int,
    congested: Mapping[Link, float],
    traffic: Traffic,
    *,
    gpu_of_rank: Sequence[int] | IntArray | None = None,
) -> RoleSwapPlan:
    """Node role swaps that move congested links (node pair -> slowdown factor > 1) onto PP."""
    layout = checked_layout(shape, gpu_of_rank)
    if gpus_per_node < 1 or shape.world % gpus_per_node:
        raise ValueError(f"gpus_per_node {gpus_per_node} must divide the world size {shape.world}")
    nodes = shape.world // gpus_per_node
    links = _links(congested, nodes)
    factor = {link: float(congested[link] if link in congested else congested[link[::-1]])
              for link in links}

    def score(lay: IntArray) -> tuple[float, dict[Link, LinkLoad]]:
        loads = link_loads(shape, gpus_per_node, lay, traffic, links)
        return float(sum((factor[k] - 1.0) * (v.dp_bytes + v.pp_bytes) for k, v in loads.items())), loads

    start_score, start_loads = score(layout)
    current, current_score, pairs = layout.copy(), start_score, []
    for _ in range(len(links)):
        best: tuple[float, int, int, int, IntArray] | None = None
        loads = link_loads(shape, gpus_per_node, current, traffic, links)
        for a, b in links:
            if loads[(a, b)].dp_bytes == 0:
                continue
            for end in (a, b):
                for node in range(nodes):
                    if node in (a, b):
                        continue
                    moved = _swap_nodes(current, end, node, gpus_per_node)
                    after = link_loads(shape, gpus_per_node, moved, traffic, [(a, b)])[(a, b)]
                    if after.dp_bytes or not after.pp_bytes:
                        continue  # not a role swap: DP stays, or the pair goes silent
                    s, _ = score(moved)
                    key = (s, abs(end - node), min(end, node), max(end, node), moved)
                    if best is None or key[:4] < best[:4]:
                        best = key
        if best is None or best[0] >= current_score:
            break
        current_score, current = best[0], best[4]
        pairs.append((best[2], best[3]))
    _, end_loads = score(current)
    return RoleSwapPlan(
        node_pairs=tuple(pairs),
        swaps=swaps_between(layout, current),
        gpu_of_rank=tuple(int(g) for g in current),
        before=start_loads,
        after=end_loads,
        score_before=start_score,
        score_after=current_score,
    )


def _links(congested: Mapping[Link, float], nodes: int) -> list[Link]:
    out: list[Link] = []
    for (a, b), f in congested.items():
        if not (0 <= a < nodes and 0 <= b < nodes) or a == b:
            raise ValueError(f"congested link {(a, b)}: two distinct nodes in [0, {nodes}) expected")
        if not (np.isfinite(f) and f > 1.0):
            raise ValueError(f"congested link {(a, b)}: slowdown factor {f!r} must be finite and > 1")
        out.append((min(a, b), max(a, b)))
    return sorted(set(out))


def _swap_nodes(layout: IntArray, a: int, b: int, gpus_per_node: int) -> IntArray:
    """Every GPU of node a takes the ranks of the GPU at the same position on node b, and back."""
    node = layout // gpus_per_node
    out = layout.copy()
    on_a, on_b = node == a, node == b
    out[on_a] = layout[on_a] + (b - a) * gpus_per_node
    out[on_b] = layout[on_b] + (a - b) * gpus_per_node
    return out
