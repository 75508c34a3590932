"""Turn a solved pipeline schedule into the per-rank NCCL records of one iteration.

Everything is broadcast over (operation, DP group, TP rank) arrays; a 4,096-GPU iteration's
~200,000 records are built without a Python loop over ranks or calls. Each record gets both
timelines: the GPU's (from the schedule) and the host's (from its launch work, see
:class:`CallOrder`); a GPU never reaches a call before its host enqueued it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from greyhound.core.arrays import FloatArray, IntArray
from greyhound.sim.events import CommTable, EventBlock, Op
from greyhound.sim.schedule import PipelineOrder, pipeline_order


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
class CallOrder:
    """Where each call falls in its host's program order within one iteration, per stage.

    A stage's host issues, for each of its operations in turn: the receive of the operation's
    input (posted before its kernels), the kernels, the operation's TP all-reduce, then the send
    of its output; after the last operation, the DP all-reduce. The fields are the 0-based index
    of each such NCCL call among the stage's calls (by operation ``o``; ``dp_at`` by stage), and
    with them the host's NCCL launch costs until that point.
    """

    recv_at: IntArray
    allreduce_at: IntArray
    send_at: IntArray
    dp_at: IntArray


@lru_cache(maxsize=256)
def call_order(pp: int, m: int, tp_calls: bool) -> CallOrder:
    order = pipeline_order(pp, m)
    n = order.n_ops
    recv = (order.dep < n).astype(np.int64)
    sends = np.zeros(n + 1, dtype=np.int64)
    sends[order.dep] = 1
    sent = sends[:n]
    per_op = recv + int(tp_calls) + sent
    per_stage = per_op.reshape(pp, 2 * m)
    base = (np.cumsum(per_stage, axis=1) - per_stage).ravel()
    return CallOrder(base, base + recv, base + recv + int(tp_calls), per_stage.sum(axis=1))


@dataclass(frozen=True, slots=True, eq=False)
class HostLaunch:
    """When the hosts of one bucket's DP groups issue their work, relative to the iteration
    start (when each host returns from the previous iteration's synchronisation).

    Each stage's host issues its operations back to back. Issuing an operation's kernels takes
    ``work`` (n_ops,) seconds times the rank's ``hosts`` multiplier (PP, DP groups, TP; its
    node's contention), and each NCCL call ``call_s`` (PP, DP groups, TP) more; ``issued`` is
    the running sum of ``work`` per stage (n_ops + 1, the sentinel last, 0).
    """

    order: PipelineOrder
    issued: FloatArray
    hosts: FloatArray
    call_s: FloatArray
    calls: CallOrder

    @classmethod
    def of(cls, order: PipelineOrder, work: FloatArray, hosts: FloatArray, call_s: FloatArray,
           tp_calls: bool) -> HostLaunch:
        issued = np.zeros(order.n_ops + 1)
        issued[:-1] = np.cumsum(work.reshape(order.pp, 2 * order.m), axis=1).ravel()
        return cls(order, issued, hosts, call_s, call_order(order.pp, order.m, tp_calls))

    def at(self, after: IntArray, stage: IntArray, index: IntArray) -> FloatArray:
        """Host time of the NCCL call numbered ``index`` among those of ``stage``, issued right
        after the kernels of operation ``after`` (the sentinel: before any), for every DP group
        and TP rank: (len(after), DP groups, TP)."""
        col = (slice(None), None, None)
        return self.issued[after][col] * self.hosts[stage] + self.call_s[stage] * index[col]

    def ready(self) -> FloatArray:
        """When each rank's host has issued an operation, its TP all-reduce included: its GPU
        cannot reach the all-reduce, nor finish the operation, before that (n_ops, DP groups,
        TP)."""
        return self._ready(self.hosts, self.call_s).reshape(self.order.n_ops, *self.hosts.shape[1:])

    def last_ready(self) -> FloatArray:
        """The latest TP rank's :meth:`ready` (n_ops, DP groups): a call's cost grows with its
        host's multiplier, so the slowest host is the latest on both counts."""
        hosts = self.hosts.max(axis=2, keepdims=True)
        out = self._ready(hosts, self.call_s.max(axis=2, keepdims=True))
        return out.reshape(self.order.n_ops, self.hosts.shape[1])

    def _ready(self, hosts: FloatArray, call_s: FloatArray) -> FloatArray:
        o = self.order
        shape = (o.pp, 2 * o.m, 1, 1)
        out: FloatArray = self.issued[:-1].reshape(shape) * hosts[:, None] \
            + call_s[:, None] * self.calls.allreduce_at.reshape(shape)
        return out


@dataclass(frozen=True, slots=True, eq=False)
class BucketRun:
    """The solved schedule of the DP groups ``ds`` that share one micro-batch count ``m``.

    ``offset`` holds each rank's own compute time per operation (n_ops, len(ds), TP): when it
    reaches the operation's TP all-reduce, unless its host has not issued the operation by
    then (``host``).
    """

    order: PipelineOrder
    ds: IntArray
    start: FloatArray
    end: FloatArray
    offset: FloatArray
    host: HostLaunch


@dataclass(frozen=True, slots=True, eq=False)
class Sizes:
    tp_bytes: int
    dp_bytes: int
    pp_bytes: int


def _timed(op: Op, rank: IntArray, gpus: IntArray, comm: IntArray, seq: IntArray, nbytes: int,
           peer: IntArray, gpu_start: FloatArray, gpu_end: FloatArray, host: FloatArray,
           call_s: FloatArray) -> EventBlock:
    """A block whose GPU cannot reach a call before its host enqueued it."""
    return EventBlock(
        op=np.full(rank.size, op, dtype=np.int8), rank=rank, gpu=gpus[rank], comm=comm, seq=seq,
        nbytes=np.full(rank.size, nbytes, dtype=np.int64), peer=peer,
        gpu_start=np.maximum(gpu_start, host), gpu_end=gpu_end, host_enter=host,
        host_return=host + call_s,
    )


def tp_block(run: BucketRun, ranks: IntArray, gpus: IntArray, comms: CommTable,
             tp_seq: IntArray, nbytes: int) -> EventBlock:
    o = run.order
    n, nb, tp = run.offset.shape
    s = o.stage
    r = ranks[s][:, run.ds, :]
    comm = (s[:, None] * comms.dp + run.ds[None, :])[:, :, None]
    k = (np.arange(n) - s * 2 * o.m)[:, None, None]
    shape = (n, nb, tp)
    host = run.host.ready()
    arrive = np.maximum(run.start[:n, :, None] + run.offset, host)
    return _timed(
        Op.ALLREDUCE, r.ravel(), gpus, np.broadcast_to(comm, shape).ravel(),
        np.broadcast_to(tp_seq[comm] + k, shape).ravel(), nbytes,
        np.full(r.size, -1, dtype=np.int64), arrive.ravel(),
        np.broadcast_to(run.end[:n, :, None], shape).ravel().copy(), host.ravel(),
        run.host.call_s[s].ravel(),
    )


def p2p_blocks(run: BucketRun, ranks: IntArray, gpus: IntArray, comms: CommTable,
               pp_seq: IntArray, xfer: FloatArray, nbytes: int) -> tuple[EventBlock, EventBlock]:
    """Receives and the matching sends; ``xfer`` (PP-1, DP, TP) is each rank pair's transfer.

    A receive is posted when its stage's previous operation is done, a send when the operation
    producing the data is; both complete together, once both are there and the data moved."""
    o, plan, host = run.order, p2p_plan(run.order.pp, run.order.m), run.host
    ops = plan.ops
    senders = o.dep[ops]
    recv_stage, send_stage = o.stage[ops], o.stage[senders]
    recv_host = host.at(o.prev[ops], recv_stage, host.calls.recv_at[ops])
    send_host = host.at(senders, send_stage, host.calls.send_at[senders])
    posted = np.maximum(run.end[o.prev[ops]][:, :, None], recv_host)
    ready = np.maximum(run.end[senders][:, :, None], send_host)
    link = np.minimum(recv_stage, send_stage)
    done = np.maximum(posted, ready) + xfer[link][:, run.ds, :]
    rr = ranks[recv_stage][:, run.ds, :]
    sr = ranks[send_stage][:, run.ds, :]
    shape = rr.shape
    tp = shape[2]
    comm = comms.pp_base + (run.ds[:, None] * tp + np.arange(tp)[None, :])
    comm_all = np.broadcast_to(comm[None], shape).ravel()
    recv = _timed(
        Op.RECV, rr.ravel(), gpus, comm_all, (pp_seq[rr] + plan.recv_seq[:, None, None]).ravel(),
        nbytes, sr.ravel(), posted.ravel(), done.ravel(), recv_host.ravel(),
        host.call_s[recv_stage].ravel())
    send = _timed(
        Op.SEND, sr.ravel(), gpus, comm_all.copy(),
        (pp_seq[sr] + plan.send_seq[:, None, None]).ravel(), nbytes, rr.ravel(), ready.ravel(),
        done.ravel().copy(), send_host.ravel(), host.call_s[send_stage].ravel())
    return recv, send


def dp_block(arrive: FloatArray, dp_exit: FloatArray, host: FloatArray, call_s: FloatArray,
             ranks: IntArray, gpus: IntArray, comms: CommTable, dp_seq: IntArray,
             nbytes: int) -> EventBlock:
    """``arrive``, ``host``, ``call_s`` (PP, DP, TP): when each rank's GPU reaches its DP
    all-reduce, when its host enqueues it, one call's host time; ``dp_exit`` (PP, TP)."""
    pp, _, tp = ranks.shape
    comm = comms.dp_base + np.arange(pp)[:, None, None] * tp + np.arange(tp)[None, None, :]
    comm_all = np.broadcast_to(comm, ranks.shape).ravel()
    return _timed(
        Op.ALLREDUCE, ranks.ravel(), gpus, comm_all, dp_seq[comm_all], nbytes,
        np.full(ranks.size, -1, dtype=np.int64), arrive.ravel(),
        np.broadcast_to(dp_exit[:, None, :], ranks.shape).ravel().copy(), host.ravel(),
        call_s.ravel(),
    )


def shifted(block: EventBlock, t0: float) -> EventBlock:
    """Move a block from iteration-relative to absolute virtual time (in place)."""
    for times in (block.gpu_start, block.gpu_end, block.host_enter, block.host_return):
        np.add(times, t0, out=times)
    return block


def busy_time(blocks: tuple[EventBlock, ...], world: int) -> FloatArray:
    """Seconds each rank's GPU spent in NCCL calls (``inf`` for a rank stuck in a hung call)."""
    total = np.zeros(world)
    for b in blocks:
        inside = np.zeros(len(b))
        np.subtract(b.gpu_end, b.gpu_start, out=inside, where=np.isfinite(b.gpu_start))
        total += np.bincount(b.rank, weights=inside, minlength=world)
    return total

