"""What a validation does, decided from the ranks' communicator status alone (pure, no I/O).

Three decisions: where every rank parks (one communicator per rank and a sequence number per
communicator, so that all ranks stop at the same iteration boundary and none waits inside a
collective for a parked peer), which GPUs run the GEMM check (the suspects and the peers they are compared
with), and which P2P pairs run in which round (the ring and the tree NCCL could use over each
suspect communicator, split so that no rank is in two transfers at once, O(1) rounds per group).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

from greyhound.core.p2p_rounds import binary_tree_parents, ring_rounds, tree_rounds
from greyhound.hookabi import unsigned64

PAUSE_AHEAD = 2  # iterations beyond the furthest rank: covers status taken at slightly different times
MAX_RATE_DENOMINATOR = 8  # communicators' collectives per iteration compared as ratios p/q, q <= this
RATE_SLACK = 2  # collectives a communicator's count may be off its rate (status taken mid-step)


@dataclass(frozen=True, slots=True)
class CommView:
    """One communicator as one rank sees it (from the agents' status replies)."""

    comm_id: int
    comm_rank: int
    nranks: int
    last_seq_entered: int


@dataclass(frozen=True, slots=True)
class PausePlan:
    """Each rank parks on ``comm_of_rank[rank]`` at that communicator's ``seq_of_comm`` (by
    unsigned id)."""

    comm_of_rank: dict[int, int]
    seq_of_comm: dict[int, int]

    def seq_of_rank(self, rank: int) -> int:
        return self.seq_of_comm[unsigned64(self.comm_of_rank[rank])]


@dataclass(frozen=True, slots=True)
class Transfer:
    """One P2P check: ``src`` sends to ``dst`` (global ranks) over ``comm_id``."""

    comm_id: int
    src: int
    dst: int
    src_comm_rank: int
    dst_comm_rank: int

    @property
    def link(self) -> tuple[int, int]:
        return (self.src, self.dst)


def pause_plan(comms: Mapping[int, Sequence[CommView]]) -> PausePlan:
    """All ranks park on communicators of one kind, at one sequence number beyond every rank:
    the kind whose collectives come least often, the iteration's boundary (the DP all-reduce).

    That is a consistent cut: what each rank queued before its park point has its counterparts
    queued by its peers before theirs (the iteration's tensor-parallel collectives, its pipeline
    sends and receives), so every GPU drains and no rank waits in a collective for a parked
    peer. A busier kind is not, in a pipeline: the stages reach TP all-reduce #S at different
    points of the 1F1B schedule, a stage parks before a send that the next stage's queued
    receive needs, and that rank's drain never ends (the hook's deadline fails its benchmarks;
    on the simulator, the wait is its whole timeout in every benchmark round).

    A kind is the communicators of one shape (size, stride between member ranks) that hold every
    rank exactly once and carry collectives (a pipeline pair that only sends and receives has no
    sequence number to park at); ties go to the larger, then the denser kind. When no kind covers
    the job (a rank's status missing), each rank parks on its largest communicator, the busier
    on a tie.

    The cut is per communicator: the DP communicators of different pipeline stages need not
    advance at the same rate (Megatron's buckets differ by stage), so one absolute sequence
    number would stop the stages iterations apart (:func:`cut`).
    """
    if not comms:
        raise ValueError("no ranks to pause")
    for rank, views in comms.items():
        if not views:
            raise ValueError(f"rank {rank} has no active communicator to pause on")
    chosen = _boundary_kind(comms) or {
        rank: max(views, key=lambda c: (c.nranks, c.last_seq_entered, -unsigned64(c.comm_id)))
        for rank, views in comms.items()}
    done: dict[int, int] = {}
    for c in chosen.values():
        cid = unsigned64(c.comm_id)
        done[cid] = max(done.get(cid, 0), c.last_seq_entered)
    return PausePlan({r: c.comm_id for r, c in chosen.items()}, cut(done))


def cut(done: Mapping[int, int]) -> dict[int, int]:
    """The pause sequence number of each communicator of one kind, from the collectives each has
    entered (``done``, the furthest member's): the start of one common iteration, PAUSE_AHEAD
    beyond the furthest.

    Every communicator of a kind entered its collectives since the job began at its own whole
    rate per iteration, so their counts' ratios are the ratios of their rates (2:3 for stages
    with two and three buckets), found as the simplest fraction within RATE_SLACK of them. With
    rates k_C, iteration J starts at collective k_C * J + 1 on communicator C: J is the first
    iteration beyond every count, plus PAUSE_AHEAD - 1. Equal rates give max(done) + PAUSE_AHEAD
    for all. A job whose communicators of a kind did not start together, or took extra
    collectives, gets a cut at different iterations: its ranks then do not all park (or do not
    drain) and the validation fails, resuming the job."""
    if not done:
        return {}
    least = min((n for n in done.values() if n > 0), default=0)
    ratios = {c: _ratio(n, least) for c, n in done.items()}
    scale = math.lcm(*(q for _, q in ratios.values()))
    rates = {c: max(1, p * (scale // q)) for c, (p, q) in ratios.items()}
    common = math.gcd(*rates.values())
    rates = {c: k // common for c, k in rates.items()}
    start = max(-(-n // rates[c]) for c, n in done.items()) + PAUSE_AHEAD - 1
    return {c: rates[c] * start + 1 for c in done}


def _ratio(n: int, least: int) -> tuple[int, int]:
    """n / least as the fraction p/q (q <= MAX_RATE_DENOMINATOR) with the smallest q whose
    multiple of ``least`` is within RATE_SLACK (plus 2%) of n; 1/1 when nothing ran yet."""
    if least <= 0 or n <= 0:
        return 1, 1
    slack = RATE_SLACK + 0.02 * n
    for q in range(1, MAX_RATE_DENOMINATOR + 1):
        p = max(1, round(n * q / least))
        if abs(p * least / q - n) <= slack:
            return p, q
    return max(1, round(n / least)), 1


def _boundary_kind(comms: Mapping[int, Sequence[CommView]]) -> dict[int, CommView] | None:
    """Each rank's communicator of the least busy kind that covers every rank once, or None."""
    groups = members(comms)
    kinds: dict[tuple[int, int], dict[int, CommView]] = {}
    twice: set[tuple[int, int]] = set()
    for rank, views in comms.items():
        for c in views:
            group = groups.get(unsigned64(c.comm_id))
            if group is None or c.nranks < 2:
                continue
            ordered = sorted(group)
            shape = (c.nranks, min(b - a for a, b in pairwise(ordered)))
            mine = kinds.setdefault(shape, {})
            if rank in mine:
                twice.add(shape)
            mine[rank] = c

    def busy(shape: tuple[int, int]) -> int:
        return max(c.last_seq_entered for c in kinds[shape].values())

    whole = [shape for shape, of_rank in kinds.items()
             if shape not in twice and len(of_rank) == len(comms) and busy(shape) > 0]
    if not whole:
        return None
    return kinds[min(whole, key=lambda shape: (busy(shape), -shape[0], shape[1]))]


def members(comms: Mapping[int, Sequence[CommView]]) -> dict[int, list[int]]:
    """Global ranks of every communicator (by unsigned id), in comm-rank order.

    A communicator some of whose ranks did not report is left out: its ring cannot be checked.
    """
    seen: dict[int, dict[int, int]] = {}
    size: dict[int, int] = {}
    for rank, views in comms.items():
        for c in views:
            cid = unsigned64(c.comm_id)
            seen.setdefault(cid, {})[c.comm_rank] = rank
            size[cid] = c.nranks
    return {cid: [by_rank[i] for i in range(size[cid])] for cid, by_rank in seen.items()
            if len(by_rank) == size[cid] and set(by_rank) == set(range(size[cid]))}


def gemm_ranks(suspects: Iterable[int], suspect_comms: Iterable[int],
               groups: Mapping[int, list[int]], comms: Mapping[int, Sequence[CommView]]
               ) -> list[int]:
    """The suspect GPUs and every GPU they are compared with: all members of each group a
    suspect belongs to, and of each suspect communicator. With nothing named, every rank."""
    picked: set[int] = set()
    for rank in suspects:
        if rank not in comms:
            continue
        picked.add(rank)
        for c in comms[rank]:
            picked.update(groups.get(unsigned64(c.comm_id), []))
    for cid in suspect_comms:
        picked.update(groups.get(unsigned64(cid), []))
    return sorted(picked) if picked else sorted(comms)


def suspect_comms(kind: str, comm_ids: Iterable[int], suspects: Iterable[int],
                  groups: Mapping[int, list[int]], comms: Mapping[int, Sequence[CommView]]
                  ) -> list[int]:
    """Communicators whose links are checked: those the suspicion names; when it names none
    but suspects communication, the largest group of each suspect rank (of every rank if none)."""
    named = [unsigned64(c) for c in comm_ids if unsigned64(c) in groups]
    if named or kind == "compute_slow":
        return sorted(set(named))
    ranks = [r for r in suspects if r in comms] or sorted(comms)
    out: set[int] = set()
    for r in ranks:
        multi = [c for c in comms[r] if c.nranks > 1 and unsigned64(c.comm_id) in groups]
        if multi:
            out.add(unsigned64(max(multi, key=lambda c: (c.nranks, c.last_seq_entered)).comm_id))
    return sorted(out)


def reference_comms(suspect: Iterable[int], groups: Mapping[int, list[int]],
                    node_of_rank: Mapping[int, object]) -> list[int]:
    """A comparable healthy communicator for each shape of suspect one (its size and how many
    nodes it spans): not suspected, and sharing no node with any suspect (so no congested hop),
    else the fewest shared nodes. Its links give each class of link (NVLink, network) a healthy
    time; disjoint from the suspects, its rounds run alongside theirs (no extra round). One per
    shape, not per suspect: every extra transfer lengthens the pause."""
    chosen = {unsigned64(c) for c in suspect}

    def nodes(cid: int) -> set[object]:
        return {node_of_rank.get(r, f"rank{r}") for r in groups[cid]}

    bad: set[object] = set().union(*(nodes(c) for c in chosen if c in groups))
    out: list[int] = []
    shapes: set[tuple[int, int]] = set()
    for cid in sorted(chosen):
        if cid not in groups:
            continue
        size, span = len(groups[cid]), len(nodes(cid))
        if (size, span) in shapes:
            continue
        shapes.add((size, span))
        peers = [c for c in sorted(groups) if c not in chosen and len(groups[c]) == size
                 and len(nodes(c)) == span]
        if not peers:
            continue
        best = min(peers, key=lambda c: len(nodes(c) & bad))
        chosen.add(best)
        out.append(best)
    return out


def link_classes(links: Iterable[tuple[int, int]], node_of_rank: Mapping[int, object]
                 ) -> dict[tuple[int, int], str]:
    """"nvlink" for a hop inside one node, "network" otherwise (or when a node is unknown):
    links are only compared within their class."""
    return {(a, b): "nvlink" if a in node_of_rank and b in node_of_rank
            and node_of_rank[a] == node_of_rank[b] else "network" for a, b in links}


def transfer_rounds(comm_ids: Iterable[int], groups: Mapping[int, list[int]]) -> list[list[Transfer]]:
    """Ring and binary-tree rounds of every communicator, packed so that rounds of disjoint
    communicators run together; each link (unordered pair of ranks) is checked once."""
    rounds: list[list[Transfer]] = []
    done: set[frozenset[int]] = set()
    for cid in comm_ids:
        group = groups[unsigned64(cid)]
        n = len(group)
        if n < 2:
            continue
        for plan in (ring_rounds(range(n)), tree_rounds(binary_tree_parents(n))):
            for pairs in plan:
                todo = []
                for a, b in pairs:
                    key = frozenset((group[a], group[b]))
                    if key not in done:
                        done.add(key)
                        todo.append(Transfer(unsigned64(cid), group[a], group[b], a, b))
                if todo:
                    rounds.append(todo)
    return pack_rounds(rounds)


def pack_rounds(rounds: Sequence[Sequence[Transfer]]) -> list[list[Transfer]]:
    """First fit: each round joins the first batch none of whose ranks it uses."""
    batches: list[tuple[list[Transfer], set[int]]] = []
    for rnd in rounds:
        ranks = {r for t in rnd for r in (t.src, t.dst)}
        for batch, used in batches:
            if not used & ranks:
                batch.extend(rnd)
                used.update(ranks)
                break
        else:
            batches.append((list(rnd), set(ranks)))
    return [b for b, _ in batches]
