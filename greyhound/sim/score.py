"""Scoring what the services found against the faults a scenario injected.

The services never see the fault list; a run's driver reads the incidents back (over REST) and
asks here whether each fault was found with the right kind and culprit, and how long after its
onset. Pure: scenario and incident documents in, verdicts out.

Kinds: a GPU or a node's CPUs are ``compute_slow``, a congested link ``comm_slow``, a hang its
CCL-D cause. Where a compute fault and a congested link overlap in time, ``compound="mixed"``
(the localisation report's rule) accepts only ``mixed_slow`` for both; ``compound="either"``
(the paper demo's) accepts the fault's own kind or ``mixed_slow``: each incident of a compound
episode is right when it names its own fault.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from greyhound.sim.scenario import Scenario

Compound = Literal["mixed", "either"]
EARLY_S = 2.0  # an incident entry this long before a fault's onset may still be its own


@dataclass
class Expect:
    """What a correct diagnosis of one injected fault looks like."""

    fault: str
    start_s: float
    end_s: float | None
    kinds: set[str]
    ranks: set[int] = field(default_factory=set)
    nodes: set[int] = field(default_factory=set)
    link: tuple[int, int] | None = None
    taxonomy: str = ""  # which of the six kinds this fault is scored under
    allowed: set[int] = field(default_factory=set)  # compute faults: ranks any may name
    max_named: int = 1  # hangs: how many ranks a diagnosis may name

    def overlaps(self, other: Expect) -> bool:
        inf = float("inf")
        return self.start_s < (other.end_s or inf) and other.start_s < (self.end_s or inf)


def expectations(sc: Scenario, *, compound: Compound = "mixed") -> list[Expect]:
    """One expectation per fault, in the scenario's order (see the module docstring)."""
    out = _expectations(sc)
    compute_ranks = {r for e in out if e.taxonomy == "compute_slow" for r in e.ranks}
    for e in out:
        e.allowed = compute_ranks
        if e.fault == "hang_hardware":
            e.max_named = sc.job.pp
    links = [e for e in out if e.link is not None]
    computes = [e for e in out if e.taxonomy == "compute_slow"]
    mixed_compute = [e for e in computes if any(e.overlaps(x) for x in links)]
    mixed_links = [e for e in links if any(e.overlaps(x) for x in mixed_compute)]
    for e in (*mixed_compute, *mixed_links):
        if compound == "mixed":
            e.kinds, e.taxonomy = {"mixed_slow"}, "mixed_slow"
        else:
            e.kinds = e.kinds | {"mixed_slow"}
    return out


def _expectations(sc: Scenario) -> list[Expect]:
    job = sc.job
    out: list[Expect] = []
    for f in sc.faults:
        end = None if f.duration_s is None else f.start_s + f.duration_s
        if f.kind == "gpu_slow":
            assert f.rank is not None
            out.append(Expect(f.kind, f.start_s, end, {"compute_slow"}, ranks={f.rank},
                              taxonomy="compute_slow"))
        elif f.kind == "cpu_contention":
            assert f.node is not None
            node_ranks = set(range(f.node * job.gpus_per_node, (f.node + 1) * job.gpus_per_node))
            out.append(Expect(f.kind, f.start_s, end, {"compute_slow"}, ranks=node_ranks,
                              nodes={f.node}, taxonomy="compute_slow"))
        elif f.kind == "link_congestion":
            assert f.nodes is not None
            a, b = sorted(f.nodes)
            out.append(Expect(f.kind, f.start_s, end, {"comm_slow"}, nodes={a, b}, link=(a, b),
                              taxonomy="comm_slow"))
        else:
            assert f.rank is not None
            out.append(Expect(f.kind, f.start_s, end, {f.kind}, ranks={f.rank}, taxonomy=f.kind))
    return out


def matches(e: Expect, inc: dict[str, Any]) -> tuple[bool, bool]:
    """(right kind, right culprit) of one incident line (kind, ranks, nodes, links) for one
    expectation.

    A congested link must be named as that node pair; a compute fault by its rank(s), naming no
    rank that no compute fault touched; a hang by its rank (a pipeline send/receive that never
    returns may name its pipeline, one rank per stage)."""
    kind_ok = inc["kind"] in e.kinds
    ranks, nodes = set(inc["ranks"]), set(inc["nodes"])
    links = {tuple(sorted(x)) for x in inc["links"]}
    if e.link is not None:
        culprit_ok = e.link in links or (not links and bool(nodes) and nodes <= e.nodes)
    elif e.fault in ("gpu_slow", "cpu_contention"):
        culprit_ok = bool(ranks & e.ranks) and ranks <= e.allowed
    else:
        culprit_ok = e.ranks <= ranks and len(ranks) <= e.max_named
    return kind_ok, culprit_ok


def sim_node(label: Any) -> Any:
    """The simulator names its hosts sim-node<N>; an incident names hosts when nodes are unknown,
    so the report turns them back into node numbers."""
    m = re.fullmatch(r"sim-node(\d+)", str(label))
    return int(m.group(1)) if m else label


def wall_ns(stamp: str) -> int:
    """An API timestamp (ISO 8601) as wall-clock nanoseconds."""
    return int(datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() * 1e9)


def culprit_line(kind: str, culprit: dict[str, Any]) -> dict[str, Any]:
    """An incident's (or a localisation's) culprit as :func:`matches` reads it."""
    return {"kind": kind, "ranks": list(culprit.get("ranks") or []),
            "nodes": [sim_node(n) for n in culprit.get("nodes") or []],
            "links": [[sim_node(n) for n in x] for x in culprit.get("links") or []]}


@dataclass(frozen=True, slots=True)
class Found:
    """One fault's verdict; times are virtual seconds from its onset (None: not reached)."""

    fault: int
    kind_ok: bool
    culprit_ok: bool
    incident_id: str | None = None
    kind: str | None = None
    detect_s: float | None = None
    localize_s: float | None = None  # the first localisation naming it with the right kind
    validate_s: float | None = None  # the validator's confirmation after that

    @property
    def correct(self) -> bool:
        return self.kind_ok and self.culprit_ok


def score_faults(sc: Scenario, incidents: Sequence[dict[str, Any]],
                 virtual_at: Callable[[int], float], *, compound: Compound = "either",
                 rank_of_gpu: Callable[[float], Sequence[int]] | None = None) -> list[Found]:
    """Per fault, the first localisation (in any incident, from ``EARLY_S`` before its onset
    on) that names it with the right kind; failing that, the best partial match. An incident
    that names two faults (a second slowdown noted into an open incident) counts for both.

    A fault strikes a GPU; incidents name ranks. ``rank_of_gpu(t)`` says which rank each GPU
    ran at virtual time ``t`` (a topology plan moves them); by default rank g runs on GPU g."""
    exp = expectations(sc, compound=compound)
    if rank_of_gpu is not None:
        _to_ranks(exp, rank_of_gpu)
    entries = []  # (virtual s, incident, index in its timeline, line)
    for inc in incidents:
        for i, entry in enumerate(inc.get("timeline") or []):
            if entry.get("stage") != "localized":
                continue
            d = entry.get("detail") or {}
            line = culprit_line(str(d.get("kind", inc["kind"])), d.get("culprit") or d)
            entries.append((virtual_at(wall_ns(entry["at"])), inc, i, line))
    entries.sort(key=lambda x: x[0])
    out: list[Found] = []
    for n, e in enumerate(exp):
        best: tuple[float, dict[str, Any], int, dict[str, Any]] | None = None
        partial: Found | None = None
        for x in entries:
            if x[0] < e.start_s - EARLY_S:
                continue
            k, c = matches(e, x[3])
            if k and c:
                best = x
                break
            if partial is None and c:
                partial = Found(n, k, c, x[1]["id"], x[3]["kind"])
        if best is None:
            out.append(partial or Found(n, False, False))
            continue
        at, inc, i, line = best
        out.append(Found(n, True, True, inc["id"], line["kind"],
                         _detected(inc, i, e.start_s, virtual_at) - e.start_s, at - e.start_s,
                         _validated(inc, i, virtual_at, e.start_s)))
    return out


def _to_ranks(exp: list[Expect], rank_of_gpu: Callable[[float], Sequence[int]]) -> None:
    """The GPUs each compute fault struck, as the ranks they ran at its onset."""
    for e in exp:
        if e.taxonomy in ("compute_slow", "mixed_slow") and e.link is None:
            ranks = rank_of_gpu(e.start_s)
            e.ranks = {int(ranks[g]) for g in e.ranks}
    compute = {r for e in exp if e.link is None and e.fault in ("gpu_slow", "cpu_contention")
               for r in e.ranks}
    for e in exp:
        e.allowed = compute


def _detected(inc: dict[str, Any], upto: int, onset: float,
              virtual_at: Callable[[int], float]) -> float:
    """When the incident saw the slowdown that its localisation ``upto`` names: its latest
    detection (opened or noted) before that entry and after the onset, else the entry's time."""
    timeline = inc.get("timeline") or []
    best = virtual_at(wall_ns(timeline[upto]["at"]))
    for entry in timeline[:upto]:
        at = virtual_at(wall_ns(entry["at"]))
        if entry.get("stage") == "detected" and at >= onset - EARLY_S:
            return max(at, onset)
    opened = virtual_at(wall_ns(inc["opened_at"]))
    return max(onset, opened) if opened >= onset - EARLY_S else best


def _validated(inc: dict[str, Any], after: int, virtual_at: Callable[[int], float],
               onset: float) -> float | None:
    for entry in (inc.get("timeline") or [])[after + 1:]:
        d = entry.get("detail") or {}
        if entry.get("stage") == "validated" and d.get("verdict") not in (None, "transient"):
            return virtual_at(wall_ns(entry["at"])) - onset
    return None
