"""Where a job's ranks ran, and the names its incidents give them.

A job names its nodes by number (0..N-1, from its declared placement) when it has one, else by
host name; a rank whose placement is unknown is ``rank<r>``. These names do not survive into
the next job: the fleet view maps them back to hosts (greyhound.core.fleet).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

NodeLabel = int | str  # a job's node number, a host name, or rank<r> for a rank placed nowhere


@dataclass(frozen=True)
class Placement:
    """Where one rank of one job ran."""

    host: str
    device: int
    node: int | None


def node_label(rank: int, placements: Mapping[int, Placement]) -> NodeLabel:
    """The node a rank ran on, as the job's incidents name it."""
    p = placements.get(rank)
    if p is None:
        return f"rank{rank}"
    return p.node if p.node is not None else p.host


def node_order(n: NodeLabel) -> tuple[bool, str]:
    """Node numbers in numeric order, then host names."""
    return isinstance(n, str), str(n).zfill(12)
