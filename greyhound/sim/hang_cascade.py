"""How one hung call spreads through a synchronous job: each rank's GPU runs on until it needs
a rank that is already stuck.

A real hang does not stop the cluster at one instant. The hung collective holds its own members;
a rank outside it keeps computing and running NCCL calls until its GPU reaches a call whose peers
include a stuck rank (the next TP all-reduce, the send to the next pipeline stage, the DP
all-reduce), and waits there. Diagnosis depends on that picture: ranks blocked downstream are
symptoms whose GPUs say "enqueued, waiting for someone", while the root call looks different (a
member that never enqueued it, a member with another op, a member that never completes it).
Freezing every rank at the moment of the hang would instead show every pending call as "all
enqueued, none completes". Hosts are not part of this: they enqueue the iteration and block in
its synchronisation, outside NCCL, whatever their GPUs do.

Pure numpy over the records of one iteration (``EventBlock`` columns concatenated), on the GPU
timeline: a rank's calls in the order its GPU reaches them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from greyhound.core.arrays import BoolArray, FloatArray, IntArray
from greyhound.sim.events import EventBlock, Op


def call_instances(blocks: Sequence[EventBlock]) -> IntArray:
    """An id per record (blocks concatenated) shared by the records that make one NCCL call.

    A collective is one (communicator, sequence number); a send and its receive are one call.
    :func:`greyhound.sim.timeline.p2p_blocks` emits a receive block followed by its send block,
    aligned element by element, which is what pairs them here.
    """
    parts: list[tuple[bool, IntArray]] = []  # (is a p2p pair id, ids or collective keys)
    n_pairs = 0
    i = 0
    while i < len(blocks):
        b = blocks[i]
        nxt = blocks[i + 1] if i + 1 < len(blocks) else None
        if len(b) and int(b.op[0]) == Op.RECV and nxt is not None and len(nxt) == len(b) \
                and int(nxt.op[0]) == Op.SEND:
            pair = n_pairs + np.arange(len(b), dtype=np.int64)
            n_pairs += len(b)
            parts += [(True, pair), (True, pair)]
            i += 2
        else:
            parts.append((False, b.comm * (1 << 32) + b.seq))
            i += 1
    if not parts:
        return np.zeros(0, np.int64)
    keys = [a for p2p, a in parts if not p2p]
    inverse = np.unique(np.concatenate(keys), return_inverse=True)[1] if keys else None
    out: list[IntArray] = []
    start = 0
    for p2p, a in parts:
        if p2p:
            out.append(a)
        else:
            assert inverse is not None
            out.append(inverse[start : start + len(a)].astype(np.int64) + n_pairs)
            start += len(a)
    return np.concatenate(out)


@dataclass(frozen=True, slots=True, eq=False)
class Spread:
    """``reached``: the rank's GPU got to this call; ``stuck``: reached it and it never completes.
    ``blocked_at`` is, per rank, the virtual time its GPU reached the call it waits in (``inf``:
    none)."""

    reached: BoolArray
    stuck: BoolArray
    blocked_at: FloatArray


def spread(
    rank: IntArray,
    instance: IntArray,
    arrive: FloatArray,
    world: int,
    *,
    never_returns: BoolArray,
    absent: BoolArray,
) -> Spread:
    """Propagate a hang to a fixed point.

    ``arrive`` is when each record's GPU reaches its call. ``never_returns`` marks records whose
    call never completes even though every member arrived (a failed device, a mismatched op);
    ``absent`` marks records whose rank never makes the call (it hangs before it), and that rank
    makes no later call either. A call completes only if every member reached it; a rank that
    reached a call that never completes reaches no later one.
    """
    n_inst = int(instance.max()) + 1 if len(instance) else 0
    blocked = np.full(world, np.inf)
    np.minimum.at(blocked, rank[absent], np.nextafter(arrive[absent], -np.inf))
    while True:
        reached = ~absent & (arrive <= blocked[rank])
        missing = np.bincount(instance[~reached], minlength=n_inst) > 0
        stuck = reached & (never_returns | missing[instance])
        nxt = blocked.copy()
        np.minimum.at(nxt, rank[stuck], arrive[stuck])
        if np.array_equal(nxt, blocked):
            return Spread(reached, stuck, blocked)
        blocked = nxt
