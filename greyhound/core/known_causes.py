"""A second fault while the first is open: what a new localisation adds to what is known.

When a slow job slows further, profiling it again shows every cause at once: the GPU that was
already named and, say, the link that is now congested too. The new incident must name only the
new cause, with its own culprit, so that it is validated, mitigated and closed on its own. This
module subtracts the causes the job's open incidents already name from a localisation, and, when
a job recovers only partly, picks which open incident ended from the levels each one moved.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from greyhound.core.slow_localization import LocalizedKind, NodeLabel, SlowLocalization

_U64 = 1 << 64


def _unsigned(v: int) -> int:
    return v + _U64 if v < 0 else v


def _link(pair: Sequence[Any]) -> tuple[str, str]:
    a, b = str(pair[0]), str(pair[1])
    return (a, b) if a <= b else (b, a)


class Named(Protocol):
    """What an open incident's culprit names (the analyzer's localisation of it)."""

    @property
    def compute_ranks(self) -> Sequence[int]: ...

    @property
    def comm_ids(self) -> Sequence[int]: ...

    @property
    def links(self) -> Sequence[Sequence[NodeLabel]]: ...

    @property
    def nodes(self) -> Sequence[NodeLabel]: ...


@dataclass(frozen=True, slots=True)
class KnownCauses:
    """What the job's open incidents already name (comm ids unsigned, links as node pairs)."""

    incidents: tuple[str, ...] = ()
    compute_ranks: frozenset[int] = frozenset()
    comm_ids: frozenset[int] = frozenset()
    links: frozenset[tuple[str, str]] = frozenset()
    nodes: frozenset[str] = field(default_factory=frozenset)

    @property
    def empty(self) -> bool:
        return not (self.compute_ranks or self.comm_ids or self.links)

    @classmethod
    def from_culprits(cls, culprits: Iterable[tuple[str, Named]]) -> KnownCauses:
        """From (incident id, culprit) pairs of the job's open incidents."""
        ids: list[str] = []
        compute: set[int] = set()
        comms: set[int] = set()
        links: set[tuple[str, str]] = set()
        nodes: set[str] = set()
        for incident, culprit in culprits:
            ids.append(incident)
            compute.update(culprit.compute_ranks)
            comms.update(_unsigned(c) for c in culprit.comm_ids)
            links.update(_link(p) for p in culprit.links)
            nodes.update(str(n) for n in culprit.nodes)
        return cls(tuple(ids), frozenset(compute), frozenset(comms), frozenset(links),
                   frozenset(nodes))


def new_causes(loc: SlowLocalization, known: KnownCauses) -> SlowLocalization:
    """The localisation less what is already known.

    A communicator counts as known when the open incidents name it, or when every link it is
    suspected on is a known link; ranks named only through a known cause go with it. When
    nothing new is left the result is kind ``none`` (not transient: the job is still slow) and
    its evidence says ``known_only``, so the caller can tell "the known cause got worse" from
    "nothing found".
    """
    if known.empty or loc.kind == "none":
        return loc
    new_links = [p for p in loc.links if _link(p) not in known.links]
    compute = [r for r in loc.compute_ranks if r not in known.compute_ranks]
    comm_ids = [c for c in loc.comm_ids if _unsigned(c) not in known.comm_ids]
    if loc.links and not new_links:
        comm_ids = []  # every suspected link is already named: the same congestion
    kind: LocalizedKind = ("mixed_slow" if compute and comm_ids else "compute_slow" if compute
                           else "comm_slow" if comm_ids else "none")
    dropped_compute = set(loc.compute_ranks) - set(compute)
    ranks = (sorted(set(loc.ranks) - dropped_compute) if comm_ids else compute)
    if kind == "comm_slow" and new_links:
        nodes: list[NodeLabel] = sorted({n for p in new_links for n in p}, key=str)
    else:
        nodes = [n for n in loc.nodes if str(n) not in known.nodes] or (
            list(loc.nodes) if kind != "none" else [])
    evidence = {**loc.evidence, "known": {
        "incidents": list(known.incidents), "compute_ranks": sorted(known.compute_ranks),
        "comm_ids": sorted(known.comm_ids), "links": [list(p) for p in sorted(known.links)]}}
    if kind == "none":
        evidence["known_only"] = True
    return replace(loc, kind=kind, transient=False, ranks=ranks, compute_ranks=compute,
                   comm_ids=comm_ids,
                   slow_groups=[g for g in loc.slow_groups if g in set(comm_ids)],
                   nodes=nodes, links=new_links if comm_ids else [], evidence=evidence)


@dataclass(frozen=True, slots=True)
class OpenStep:
    """An open slowdown incident and the level change it was opened for."""

    incident: str
    before_s: float
    after_s: float


def ended_by(steps: Sequence[OpenStep], before_s: float, after_s: float) -> str | None:
    """Which open incident a partial recovery from before_s to after_s most likely closes.

    The one whose own step (as a ratio) is nearest the fall; on a tie the newest, since a second
    fault that came and went is more common than the first one ending under it. None when no
    incident has a usable step.
    """
    if before_s <= 0 or after_s <= 0:
        return None
    fall = math.log(before_s / after_s)
    best: tuple[float, int] | None = None
    pick: str | None = None
    for order, s in enumerate(steps):
        if s.before_s <= 0 or s.after_s <= s.before_s:
            continue
        gap = abs(math.log(s.after_s / s.before_s) - fall)
        key = (round(gap, 6), -order)
        if best is None or key < best:
            best, pick = key, s.incident
    return pick
