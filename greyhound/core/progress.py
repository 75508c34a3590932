"""CCL-D's kernel-level progress counters, from NCCL's profiler events: where inside a
collective the ranks stopped, and which link is slow, without pausing training.

Each row is one (rank, communicator, channel, peer, direction) of network transfers, as the
hook's profiler plugin counts it: steps posted and done (CCL-D's SendCount and RecvCount), bytes
and time on the network, how long ago it last moved (on its own host's clock, so nothing here
compares clocks across hosts), and its rates over the agent's sampling window (SendRate and
RecvRate: steps done per second; bytes per second of network time). A ``KERNEL`` row is one
channel's kernel: starts and stops.

Inside a hung collective every rank waits, so "who is pending" names everyone. The counters say
more, with no clock: on a ring channel a rank forwards what it received, so when one rank stops
sending, every later rank stops one step later than the one before it, and the link out of the
rank that stopped first has the fewest steps done (CCL-D: the culprit has the fewest counts).
Which end of that link stopped shows in its two counters: the sender's steps done equal to the
receiver's says the sender stopped sending (its GPU, or what feeds it); more done on the sender
than on the receiver says the data left and never arrived (the network, or the receiver).

A slow link cannot be told from step rates on a ring: every link is paced by the slowest one. But
each send step's time on the network (going on the wire to done) is its own link's, so bytes per
second of network time name the slow link against the communicator's other links.

What is not seen: transfers between ranks of one node (NVLink, PCIe, shared memory) have no
proxy events in NCCL, hence no rows here; a stop on such a link shows as the first network link
after it, and a kernel row (a channel that started and never stopped) is all there is of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from greyhound.core.arrays import FloatArray, IntArray
from greyhound.core.localize import Evidence
from greyhound.hookabi.layout import signed64

SEND, RECV, KERNEL = 0, 1, 2


@dataclass(frozen=True, slots=True, eq=False)
class ProgressSample:
    """One element per (rank, communicator, channel, peer, kind), as agents sample them.

    ``rank`` is the owner's global rank and ``comm_rank`` its rank in the communicator;
    ``peer`` is the peer's rank in the communicator (-1 for a kernel row). ``posted``/``done``
    count network steps (kernel rows: starts and stops); ``stalled_s`` is how long ago the row
    last moved; ``rate`` (steps/s), ``byte_rate`` (bytes/s) and ``net_bw`` (bytes per second of
    network time) are over the agent's last sampling window, 0 when unknown.
    """

    rank: IntArray
    comm_id: IntArray  # as int64 (ids past 2^63 wrap, as the other cores take them)
    comm_rank: IntArray
    kind: IntArray
    channel: IntArray
    peer: IntArray
    posted: IntArray
    done: IntArray
    bytes: IntArray
    net_s: FloatArray
    stalled_s: FloatArray
    seq: IntArray
    rate: FloatArray
    byte_rate: FloatArray
    net_bw: FloatArray

    def __post_init__(self) -> None:
        ids = self.comm_id
        if not isinstance(ids, np.ndarray) or ids.dtype != np.int64:  # ids are unsigned in rings
            object.__setattr__(self, "comm_id", [signed64(int(c)) for c in np.asarray(ids).reshape(-1)])
        for name in self.__slots__:
            dtype = np.float64 if name in _FLOATS else np.int64
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=dtype).reshape(-1))
        n = len(self.rank)
        if any(len(getattr(self, f)) != n for f in self.__slots__):
            raise ValueError("ProgressSample arrays must have equal lengths")

    def __len__(self) -> int:
        return len(self.rank)

    @classmethod
    def from_columns(cls, cols: dict[str, Any]) -> ProgressSample:
        """From columnar rows (a ProgressRows message's fields, the same names)."""
        return cls(**{name: cols[name] for name in cls.__slots__})

    def take(self, keep: NDArray[np.bool_] | IntArray) -> ProgressSample:
        return ProgressSample(**{f: getattr(self, f)[keep] for f in self.__slots__})


_FLOATS = frozenset({"net_s", "stalled_s", "rate", "byte_rate", "net_bw"})


def window_rates(done0: IntArray, done1: IntArray, bytes0: IntArray, bytes1: IntArray,
                 net0_s: FloatArray, net1_s: FloatArray, dt_s: float
                 ) -> tuple[FloatArray, FloatArray, FloatArray]:
    """CCL-D's rates over one sampling window of ``dt_s`` seconds: steps done per second, bytes
    per second, and bytes per second of network time (0 where the window saw none). Counters
    that went backwards (a slot reused by another communicator) give 0."""
    if dt_s <= 0:
        z = np.zeros(len(done1))
        return z, z.copy(), z.copy()
    d_steps = np.asarray(done1, np.float64) - np.asarray(done0, np.float64)
    d_bytes = np.asarray(bytes1, np.float64) - np.asarray(bytes0, np.float64)
    d_net = np.asarray(net1_s, np.float64) - np.asarray(net0_s, np.float64)
    ok = (d_steps >= 0) & (d_bytes >= 0) & (d_net >= 0)
    rate = np.where(ok, d_steps / dt_s, 0.0)
    byte_rate = np.where(ok, d_bytes / dt_s, 0.0)
    net_bw = np.where(ok & (d_net > 0), d_bytes / np.where(d_net > 0, d_net, 1.0), 0.0)
    return rate, byte_rate, net_bw


@dataclass(frozen=True, slots=True)
class StalledLink:
    """One network link of a channel, by its two ends' counters (-1: that end has no row)."""

    channel: int
    src: int  # comm ranks
    dst: int
    src_rank: int  # global ranks, -1 unknown
    dst_rank: int
    sent: int
    received: int
    posted: int

    @property
    def least(self) -> int:
        return min(x for x in (self.sent, self.received) if x >= 0)

    @property
    def stopped(self) -> str:
        """Which end stopped: the sender (nothing more left it), or the network or receiver
        (more left the sender than arrived)."""
        if self.sent >= 0 and self.received >= 0 and self.sent > self.received:
            return "network_or_receiver"
        return "sender"

    def evidence(self) -> dict[str, int | str]:
        return {"channel": self.channel, "src": self.src, "dst": self.dst,
                "src_rank": self.src_rank, "dst_rank": self.dst_rank, "sent": self.sent,
                "received": self.received, "posted": self.posted, "stopped": self.stopped}


@dataclass(frozen=True, slots=True)
class InsideCollective:
    """Where a hung communicator's ranks stopped inside their collective."""

    comm_id: int
    seq: int  # the collective (the comm table's seq) the stuck steps belong to, 0 unknown
    channels: list[int]  # channels with steps that stopped
    links: list[StalledLink]  # per such channel, the link that stopped first
    first_rank: int  # global rank that stopped first (the sender of those links), -1 unknown
    first_comm_rank: int
    kernels_open: list[int] = field(default_factory=list)  # channels whose kernel never stopped

    def evidence(self) -> Evidence:
        """Flat keys, to sit beside a diagnosis's own."""
        return {"inside_seq": self.seq, "inside_channels": list[object](self.channels),
                "inside_links": [link.evidence() for link in self.links],
                "first_stopped_rank": self.first_rank,
                "first_stopped_comm_rank": self.first_comm_rank,
                "kernels_open": list[object](self.kernels_open)}


def inside_collective(s: ProgressSample, comm_id: int, *, stall_s: float
                      ) -> InsideCollective | None:
    """The link that stopped first on each channel of ``comm_id`` where network steps were
    posted and not done for ``stall_s`` (on the owner's clock), and the rank that stopped first:
    the sender of the link with the fewest steps done (the most channels' choice, then the
    fewest steps). None when no network step of it is stuck (no rows: intra-node only, or the
    plugin off)."""
    mine = s.comm_id == comm_id
    net = mine & (s.kind != KERNEL)
    stuck = net & (s.posted > s.done) & (s.stalled_s >= stall_s)
    if not np.any(stuck):
        return None
    rank_of = _global_ranks(s, mine)
    channels = sorted({int(c) for c in s.channel[stuck]})
    links: list[StalledLink] = []
    for ch in channels:
        rows = np.flatnonzero(net & (s.channel == ch))
        ends: dict[tuple[int, int], list[int]] = {}
        for i in rows.tolist():
            me, peer = int(s.comm_rank[i]), int(s.peer[i])
            key = (me, peer) if s.kind[i] == SEND else (peer, me)
            slot = ends.setdefault(key, [-1, -1, 0, 0])
            slot[0 if s.kind[i] == SEND else 1] = int(s.done[i])
            slot[2] = max(slot[2], int(s.posted[i]))
            slot[3] |= int(stuck[i])
        cands = [StalledLink(ch, a, b, rank_of.get(a, -1), rank_of.get(b, -1), e[0], e[1], e[2])
                 for (a, b), e in sorted(ends.items()) if e[3]]
        if cands:
            links.append(min(cands, key=lambda link: (link.least, link.src)))
    votes: dict[int, tuple[int, int]] = {}
    for link in links:
        n, low = votes.get(link.src, (0, link.least))
        votes[link.src] = (n + 1, min(low, link.least))
    first = min(votes, key=lambda r: (-votes[r][0], votes[r][1], r)) if votes else -1
    seqs = s.seq[stuck]
    kern = mine & (s.kind == KERNEL) & (s.posted > s.done) & (s.stalled_s >= stall_s)
    return InsideCollective(
        comm_id=comm_id, seq=int(seqs.max()) if len(seqs) else 0, channels=channels, links=links,
        first_rank=rank_of.get(first, -1), first_comm_rank=first,
        kernels_open=sorted({int(c) for c in s.channel[kern]}))


def _global_ranks(s: ProgressSample, rows: NDArray[np.bool_]) -> dict[int, int]:
    """comm rank -> global rank, as the rows' owners say."""
    return {int(c): int(r) for c, r in zip(s.comm_rank[rows].tolist(), s.rank[rows].tolist(),
                                           strict=True)}


@dataclass(frozen=True, slots=True)
class SlowLink:
    """A link whose bytes per second on the network fell below ``ratio`` of its peers' median."""

    comm_id: int
    src: int
    dst: int
    src_rank: int
    dst_rank: int
    channels: list[int]
    bandwidth: float  # bytes per second of network time, over the window
    others: float  # the median of the communicator's other links

    def evidence(self) -> Evidence:
        return {"comm_id": self.comm_id, "src": self.src, "dst": self.dst,
                "src_rank": self.src_rank, "dst_rank": self.dst_rank,
                "channels": list[object](self.channels), "bandwidth_Bps": self.bandwidth,
                "others_Bps": self.others, "ratio": self.bandwidth / self.others}


def slow_links(s: ProgressSample, *, ratio: float = 0.5) -> list[SlowLink]:
    """Per communicator, the links (a sender's slots to one peer, channels together) whose
    network bandwidth over the window is under ``ratio`` of the median of the communicator's
    other links. Only send rows count: a send step's network time is its own link's, while a
    receive waits for whatever feeds its sender. Slowest first."""
    sends = (s.kind == SEND) & (s.net_bw > 0)
    out: list[SlowLink] = []
    for comm in sorted({int(c) for c in s.comm_id[sends]}):
        rows = np.flatnonzero(sends & (s.comm_id == comm))
        rank_of = _global_ranks(s, s.comm_id == comm)
        per: dict[tuple[int, int], list[float]] = {}
        chans: dict[tuple[int, int], set[int]] = {}
        for i in rows.tolist():
            key = (int(s.comm_rank[i]), int(s.peer[i]))
            per.setdefault(key, []).append(float(s.net_bw[i]))
            chans.setdefault(key, set()).add(int(s.channel[i]))
        bw = {k: float(np.median(v)) for k, v in per.items()}
        if len(bw) < 2:
            continue
        for key, b in bw.items():
            others = float(np.median([v for k, v in bw.items() if k != key]))
            if b < ratio * others:
                out.append(SlowLink(comm, key[0], key[1], rank_of.get(key[0], -1),
                                    rank_of.get(key[1], -1), sorted(chans[key]), b, others))
    return sorted(out, key=lambda x: x.bandwidth / x.others)
