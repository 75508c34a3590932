"""Naming what the validator confirmed in the job's hardware (pure): its verdict's slow GPUs
(by rank) and slow links (by rank pair), with where each rank ran.

The incident's culprit then names each slow GPU with its node, host and local device, each
congested link once as a node pair (many rank pairs cross one), ``link_ranks`` (the rank
pairs as checked) and ``slow_ranks`` (every rank either touches). ``ranks`` are the slow GPUs'
ranks; a link's end ranks join them only when no GPU is slow, so a mixed incident does not
blame every rank that shares the congested link.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from greyhound.core.placement import NodeLabel, Placement, node_label, node_order


@dataclass(frozen=True)
class NamedGpu:
    rank: int
    node: NodeLabel
    host: str | None
    device: int | None


@dataclass(frozen=True)
class NamedCulprit:
    gpus: list[NamedGpu]
    links: list[tuple[NodeLabel, NodeLabel]]
    link_ranks: list[tuple[int, int]]
    slow_ranks: list[int]
    ranks: list[int]
    nodes: list[NodeLabel]


def name_culprit(gpus: Sequence[int], links: Sequence[tuple[int, int]],
                 placements: Mapping[int, Placement]) -> NamedCulprit:
    """The confirmed GPUs (with node, host, local device) and links (as node pairs)."""
    named = [NamedGpu(g, node_label(g, placements),
                      placements[g].host if g in placements else None,
                      placements[g].device if g in placements else None) for g in gpus]
    pairs: list[tuple[NodeLabel, NodeLabel]] = []  # node pairs, each once
    for a, b in links:
        x, y = sorted((node_label(a, placements), node_label(b, placements)), key=node_order)
        if (x, y) not in pairs:
            pairs.append((x, y))
    slow = sorted({*gpus, *(r for link in links for r in link)})
    nodes = sorted({node_label(r, placements) for r in slow}, key=node_order)
    return NamedCulprit(named, pairs, [(a, b) for a, b in links], slow,
                        sorted(set(gpus)) or slow, nodes)
