"""The fleet view: each GPU, node and link with its incident history across jobs, and a drain
advice for repeat offenders (pure: incidents and rank placements in, components out).

A job names its nodes by number (0..N-1) and its GPUs by rank; neither survives into the next
job, so both are mapped to hardware names first: a GPU is ``host:device``, a node its host name
and a link the sorted pair of its end hosts (``a<->b``).

The drain rule: a component is advised for draining when at least ``drain_incidents``
*confirmed* incidents named it within the last ``window`` and they came from at least
``drain_jobs`` different jobs. Confirmed means the validator reproduced the fault on the
hardware (a GEMM or P2P check, verdict not transient); an incident only localised from
profiling counts as a suspicion. Spreading over jobs is required so one job's own trouble
(its input pipeline, its code) does not condemn the hardware it happened to run on. A component
that reaches the count with suspicions included, or the count in one job only, is to be
watched. A node is charged with its own incidents and those of its GPUs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

from greyhound.core.placement import NodeLabel, Placement

ComponentKind = Literal["gpu", "node", "link"]
Advice = Literal["drain", "watch", "ok"]


@dataclass(frozen=True)
class BlamedGpu:
    """A GPU the validator confirmed: its rank, and its host and device when it knew them."""

    rank: int
    host: str | None = None
    device: int | None = None


@dataclass(frozen=True)
class FleetIncident:
    """What an incident blames, in the job's own names: the validator's GPUs, the analyzer's
    compute ranks (None: it named none), the incident's ranks, its node pairs and nodes; and
    whether the validator reproduced the fault on the hardware."""

    id: str
    job_id: str
    kind: str
    opened_at: datetime
    confirmed: bool
    gpus: tuple[BlamedGpu, ...] = ()
    compute_ranks: tuple[int, ...] | None = None
    ranks: tuple[int, ...] = ()
    links: tuple[tuple[NodeLabel, NodeLabel], ...] = ()
    nodes: tuple[NodeLabel, ...] = ()


@dataclass
class Sighting:
    incident_id: str
    job_id: str
    kind: str
    opened_at: datetime
    confirmed: bool


@dataclass
class Component:
    kind: ComponentKind
    id: str
    host: str | None
    device: int | None = None
    sightings: list[Sighting] = field(default_factory=list)
    advice: Advice = "ok"
    reason: str = ""

    @property
    def confirmed(self) -> int:
        return sum(s.confirmed for s in self.sightings)

    @property
    def jobs(self) -> list[str]:
        return sorted({s.job_id for s in self.sightings})

    @property
    def last_at(self) -> datetime:
        return max(s.opened_at for s in self.sightings)


def _host_of_node(node: NodeLabel, placements: Mapping[int, Placement]) -> str | None:
    if isinstance(node, str):
        # The validator writes "rank<r>" for a rank it had no placement of: no host known.
        return None if node.startswith("rank") and node[4:].isdigit() else node
    if isinstance(node, int):
        hosts = {p.host for p in placements.values() if p.node == node}
        if len(hosts) == 1:
            return hosts.pop()
    return None


def _gpus(inc: FleetIncident, placements: Mapping[int, Placement]) -> list[tuple[str, int]]:
    """The GPUs the incident blames: the validator's (with host and device), else the compute
    ranks the analyzer localised."""
    out: list[tuple[str, int]] = []
    if inc.gpus:
        for g in inc.gpus:
            if g.host is not None and g.device is not None:
                out.append((g.host, g.device))
            elif g.rank in placements:
                p = placements[g.rank]
                out.append((p.host, p.device))
        return out
    ranks = inc.compute_ranks
    if ranks is None and inc.kind == "compute_slow":
        ranks = inc.ranks
    for r in ranks or ():
        if r in placements:
            out.append((placements[r].host, placements[r].device))
    return out


def _links(inc: FleetIncident, placements: Mapping[int, Placement]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for pair in inc.links:
        a, b = (_host_of_node(n, placements) for n in pair)
        if a is not None and b is not None and a != b:
            x, y = sorted((a, b))
            out.append((x, y))
    return out


def _nodes(inc: FleetIncident, placements: Mapping[int, Placement]) -> list[str]:
    hosts = {h for n in inc.nodes if (h := _host_of_node(n, placements))}
    return sorted(hosts)


def build_fleet(incidents: Iterable[FleetIncident],
                placements: Mapping[str, Mapping[int, Placement]], *, now: datetime,
                window: timedelta, drain_incidents: int, drain_jobs: int) -> list[Component]:
    """Every component named by an incident opened within ``window``, worst first."""
    comps: dict[tuple[ComponentKind, str], Component] = {}

    def see(kind: ComponentKind, key: str, inc: FleetIncident, confirmed: bool, *,
            host: str | None, device: int | None = None) -> None:
        c = comps.setdefault((kind, key), Component(kind=kind, id=key, host=host, device=device))
        if all(s.incident_id != inc.id for s in c.sightings):
            c.sightings.append(Sighting(inc.id, inc.job_id, inc.kind, inc.opened_at, confirmed))

    for inc in incidents:
        if inc.opened_at < now - window or inc.kind.startswith("hang"):
            continue  # hangs name software states (who did not enter), not hardware
        where = placements.get(inc.job_id, {})
        confirmed = inc.confirmed
        gpus = _gpus(inc, where)
        for host, device in gpus:
            see("gpu", f"{host}:{device}", inc, confirmed, host=host, device=device)
            see("node", host, inc, confirmed, host=host)
        for a, b in _links(inc, where):
            see("link", f"{a}<->{b}", inc, confirmed, host=None)
        if not gpus:
            for host in _nodes(inc, where):
                see("node", host, inc, confirmed, host=host)
    for c in comps.values():
        c.advice, c.reason = advise(c, drain_incidents=drain_incidents, drain_jobs=drain_jobs)
    order = {"drain": 0, "watch": 1, "ok": 2}
    return sorted(comps.values(), key=lambda c: (order[c.advice], -c.confirmed,
                                                 -len(c.sightings), c.kind, c.id))


def advise(c: Component, *, drain_incidents: int, drain_jobs: int) -> tuple[Advice, str]:
    confirmed_jobs = {s.job_id for s in c.sightings if s.confirmed}
    if c.confirmed >= drain_incidents and len(confirmed_jobs) >= drain_jobs:
        return "drain", (f"{c.confirmed} confirmed incidents in {len(confirmed_jobs)} jobs "
                         f"(rule: >= {drain_incidents} in >= {drain_jobs} jobs)")
    if len(c.sightings) >= drain_incidents:
        return "watch", (f"{len(c.sightings)} incidents ({c.confirmed} confirmed) in "
                         f"{len(c.jobs)} job(s): short of the drain rule")
    return "ok", f"{len(c.sightings)} incident(s), {c.confirmed} confirmed"


def placements_of(ranks: Sequence[tuple[str, int, str, int, int | None]]
                  ) -> dict[str, dict[int, Placement]]:
    """(job, rank, host, device, node) rows as job -> rank -> placement."""
    out: dict[str, dict[int, Placement]] = {}
    for job, rank, host, device, node in ranks:
        out.setdefault(job, {})[rank] = Placement(host=host, device=device, node=node)
    return out
