"""Turn a solved pipeline schedule into the per-rank NCCL records of one iteration.

Everything is broadcast over (operation, DP group, TP rank) arrays; a 4,096-GPU iteration's
~200,000 records are built without a Python loop over ranks or calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from greyhound.sim.events import CommTable, EventBlock, Op
from greyhound.sim.schedule import FloatArray, IntArray, PipelineOrder, pipeline_order


@dataclass(frozen=True, slots=True, eq=False)
class P2pPlan:
    """The send/recv calls of a (PP, m) pipeline: one pair per operation that receives input.

    ``recv_seq``/``send_seq`` number each call among its own rank's P2P calls in the iteration
    (a receive is posted before its operation, a send follows the operation that produced the
    data); ``per_stage`` is how many P2P calls each stage's ranks make.
    """

    ops: IntArray
    recv_seq: IntArray
    send_seq: IntArray
    per_stage: IntArray


@lru_cache(maxsize=256)
def p2p_plan(pp: int, m: int) -> P2pPlan:
    order = pipeline_order(pp, m)
    n = order.n_ops
    ops = np.flatnonzero(order.dep < n)
    senders = order.dep[ops]
    stage_of_call = np.concatenate([order.stage[ops], order.stage[senders]])
    key = np.concatenate([2 * ops, 2 * senders + 1])
    sort = np.lexsort((key, stage_of_call))
    local = np.empty(len(key), dtype=np.int64)
    counts = np.bincount(stage_of_call, minlength=pp)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    local[sort] = np.arange(len(key)) - np.repeat(starts, counts)
    return P2pPlan(ops, local[: len(ops)], local[len(ops) :], counts.astype(np.int64))


@dataclass(frozen=True, slots=True, eq=False)
class BucketRun:
    """The solved schedule of the DP groups ``ds`` that share one micro-batch count ``m``.

    ``offset`` holds each rank's own compute time per operation (n_ops, len(ds), TP): when it
    reaches the operation's TP all-reduce.
    """

    order: PipelineOrder
    ds: IntArray
    start: FloatArray
    end: FloatArray
    offset: FloatArray


@dataclass(frozen=True, slots=True, eq=False)
class Sizes:
    tp_bytes: int
    dp_bytes: int
    pp_bytes: int


def tp_block(run: BucketRun, ranks: IntArray, gpus: IntArray, comms: CommTable,
             tp_seq: IntArray, nbytes: int) -> EventBlock:
    o = run.order
    n, nb, tp = run.offset.shape
    s = o.stage
    r = ranks[s][:, run.ds, :]
    comm = (s[:, None] * comms.dp + run.ds[None, :])[:, :, None]
    k = (np.arange(n) - s * 2 * o.m)[:, None, None]
    shape = (n, nb, tp)
    return EventBlock(
        op=np.full(r.size, Op.ALLREDUCE, dtype=np.int8),
        rank=r.ravel(),
        gpu=gpus[r].ravel(),
        comm=np.broadcast_to(comm, shape).ravel(),
        seq=np.broadcast_to(tp_seq[comm] + k, shape).ravel(),
        nbytes=np.full(r.size, nbytes, dtype=np.int64),
        peer=np.full(r.size, -1, dtype=np.int64),
        enter=(run.start[:n, :, None] + run.offset).ravel(),
        exit=np.broadcast_to(run.end[:n, :, None], shape).ravel().copy(),
    )


def p2p_blocks(run: BucketRun, ranks: IntArray, gpus: IntArray, comms: CommTable,
               pp_seq: IntArray, xfer: FloatArray, nbytes: int) -> tuple[EventBlock, EventBlock]:
    """Receives and the matching sends; ``xfer`` (PP-1, DP, TP) is each rank pair's transfer."""
    o, plan = run.order, p2p_plan(run.order.pp, run.order.m)
    ops = plan.ops
    recv_stage, send_stage = o.stage[ops], o.stage[o.dep[ops]]
    posted = run.end[o.prev[ops]]
    ready = run.end[o.dep[ops]]
    link = np.minimum(recv_stage, send_stage)
    done = np.maximum(posted, ready)[:, :, None] + xfer[link][:, run.ds, :]
    rr = ranks[recv_stage][:, run.ds, :]
    sr = ranks[send_stage][:, run.ds, :]
    shape = rr.shape
    tp = shape[2]
    comm = comms.pp_base + (run.ds[:, None] * tp + np.arange(tp)[None, :])
    comm_all = np.broadcast_to(comm[None], shape).ravel()
    size = np.full(rr.size, nbytes, dtype=np.int64)
    exit_ = done.ravel()
    recv = EventBlock(
        op=np.full(rr.size, Op.RECV, dtype=np.int8), rank=rr.ravel(), gpu=gpus[rr].ravel(),
        comm=comm_all, seq=(pp_seq[rr] + plan.recv_seq[:, None, None]).ravel(), nbytes=size,
        peer=sr.ravel(), enter=np.broadcast_to(posted[:, :, None], shape).ravel().copy(),
        exit=exit_,
    )
    send = EventBlock(
        op=np.full(sr.size, Op.SEND, dtype=np.int8), rank=sr.ravel(), gpu=gpus[sr].ravel(),
        comm=comm_all, seq=(pp_seq[sr] + plan.send_seq[:, None, None]).ravel(), nbytes=size,
        peer=rr.ravel(), enter=np.broadcast_to(ready[:, :, None], shape).ravel().copy(),
        exit=exit_.copy(),
    )
    return recv, send


def dp_block(last: FloatArray, dp_exit: FloatArray, ranks: IntArray, gpus: IntArray,
             comms: CommTable, dp_seq: IntArray, nbytes: int) -> EventBlock:
    """``last`` (PP, DP): each stage's last backward end; ``dp_exit`` (PP, TP)."""
    pp, _, tp = ranks.shape
    comm = comms.dp_base + np.arange(pp)[:, None, None] * tp + np.arange(tp)[None, None, :]
    comm_all = np.broadcast_to(comm, ranks.shape).ravel()
    return EventBlock(
        op=np.full(ranks.size, Op.ALLREDUCE, dtype=np.int8),
        rank=ranks.ravel(), gpu=gpus[ranks].ravel(), comm=comm_all, seq=dp_seq[comm_all],
        nbytes=np.full(ranks.size, nbytes, dtype=np.int64),
        peer=np.full(ranks.size, -1, dtype=np.int64),
        enter=np.broadcast_to(last[:, :, None], ranks.shape).ravel().copy(),
        exit=np.broadcast_to(dp_exit[:, None, :], ranks.shape).ravel().copy(),
    )


def shifted(block: EventBlock, t0: float) -> EventBlock:
    """Move a block from iteration-relative to absolute virtual time (in place)."""
    np.add(block.enter, t0, out=block.enter)
    np.add(block.exit, t0, out=block.exit)
    return block


def busy_time(blocks: tuple[EventBlock, ...], world: int) -> FloatArray:
    """Seconds each rank spent inside NCCL (``inf`` for a rank stuck in a hung call)."""
    total = np.zeros(world)
    for b in blocks:
        inside = np.zeros(len(b))
        np.subtract(b.exit, b.enter, out=inside, where=np.isfinite(b.enter))
        total += np.bincount(b.rank, weights=inside, minlength=world)
    return total

