"""What a simulated rank does with its control block: park at an NCCL call, answer benchmarks.

Semantics follow native/hook/control.c. A pause request parks the rank's host at the entry of
its next data-path call (or, targeted, at the call on ``pause_comm_id`` whose collective sequence
would be >= ``pause_seq``): it never enqueues that call. Its GPU still finishes the work already
queued; every peer GPU that needs the missing call waits in its own matching call, and then
everything after that, transitively (:func:`blocked_from`). While parked, the rank runs the
submitted benchmark requests, lowest id first: each first waits for the rank's queued GPU work
to drain (the wait is reported as ``drain_ns``), then is timed on the simulated hardware at that
moment. Nothing here touches files or clocks.
"""

from __future__ import annotations

import numpy as np

from greyhound import hookabi
from greyhound.core.arrays import BoolArray, IntArray
from greyhound.hookabi import BenchKind, BenchRequest, BenchState, HookControl
from greyhound.sim.model import ClusterModel
from greyhound.sim.records import comm_ids

NCCL_INVALID_ARGUMENT = 4
_K1 = np.uint64(0x9E3779B97F4A7C15)
_K2 = np.uint64(0xC2B2AE3D27D4EB4F)
_K3 = np.uint64(0x165667B19E3779F9)


def match_keys(rec: np.ndarray) -> IntArray:
    """One key per call, equal on every rank taking part in the same operation: (comm, seq)
    for collectives, (comm, sender, receiver, per-pair count) for a send and its receive."""
    op = rec["op"]
    send = op == hookabi.Op.SEND
    recv = op == hookabi.Op.RECV
    me = rec["comm_rank"].astype(np.int64)
    peer = rec["peer"].astype(np.int64)
    src = np.where(send, me, np.where(recv, peer, -1)) + 1
    dst = np.where(send, peer, np.where(recv, me, -1)) + 1
    with np.errstate(over="ignore"):
        k = rec["comm_id"].astype(np.uint64) ^ (rec["seq"].astype(np.uint64) * _K1)
        k ^= src.astype(np.uint64) * _K2
        k ^= (dst.astype(np.uint64) + np.uint64(1 << 20)) * _K3
    return k.view(np.int64)


def park_index(rec: np.ndarray, comm_id: int, seq: int, entered: BoolArray) -> int | None:
    """Where a rank parks among its pending calls (in enqueue order): the first call its host
    has not enqueued yet that matches the pause target; None if none is pending."""
    ok = ~entered
    if comm_id:
        p2p = np.isin(rec["op"], hookabi.P2P_OPS)
        # The hook compares last_seq_entered + 1; the simulated PP comms carry no collectives.
        would_be = np.where(p2p, 1, rec["seq"].astype(np.int64))
        ok &= (rec["comm_id"] == np.uint64(comm_id)) & (would_be >= seq)
    hit = np.flatnonzero(ok)
    return int(hit[0]) if hit.size else None


def blocked_from(rank: IntArray, rec: np.ndarray, starts: IntArray, ends: IntArray,
                 parked: dict[int, int], done: BoolArray) -> IntArray:
    """Absolute index of each rank's first pending call that cannot complete on its GPU
    (``ends[r]``: none), given the index of the call each parked rank's host stopped at. A call
    is stuck when a peer's part of it is; the GPU runs a rank's calls in order, so everything
    after a stuck call is stuck too, except what already completed (``done``)."""
    first = ends.copy()
    for r, i in parked.items():
        first[r] = min(first[r], i)
    keys = match_keys(rec)
    pos = np.arange(len(rec))
    while True:
        stuck = (pos >= first[rank]) & ~done
        hit = np.isin(keys, keys[stuck]) & ~stuck & ~done
        if not hit.any():
            return first
        np.minimum.at(first, rank[hit], pos[hit])


def answer_request(ctl: HookControl, model: ClusterModel, rank: int, req_id: int,
                   req: BenchRequest, t: float, rng: np.random.Generator, *, drain_ns: int) -> None:
    """Run one benchmark of a parked rank at virtual time ``t`` (its queued work drained)."""
    if not 1 <= req.repeat <= hookabi.BENCH_MAX_REPEAT:
        ctl.answer(req_id, BenchState.FAILED, [], NCCL_INVALID_ARGUMENT, drain_ns)
    elif req.kind == BenchKind.GEMM:
        gpu = int(model.layout.gpu_of_rank[rank])
        _finish(ctl, req_id, model.gemm_s(gpu, req.size, t), req.repeat, model, rng, drain_ns)
    elif req.kind in (BenchKind.SEND, BenchKind.RECV):
        peer_gpu = _peer_gpu(model, rank, req.comm_id, req.peer)
        if peer_gpu is None:
            ctl.answer(req_id, BenchState.FAILED, [], NCCL_INVALID_ARGUMENT, drain_ns)
        else:
            me = int(model.layout.gpu_of_rank[rank])
            a, b = (me, peer_gpu) if req.kind == BenchKind.SEND else (peer_gpu, me)
            _finish(ctl, req_id, model.p2p_s(a, b, req.size, t), req.repeat, model, rng,
                    drain_ns)
    elif req.kind in (BenchKind.DRAIN, BenchKind.SPLIT):
        # A drain has waited already; a split needs nothing the model times (the simulated
        # transfers never hold a job communicator's queue).
        ctl.answer(req_id, BenchState.DONE, [], 0, drain_ns if req.kind == BenchKind.DRAIN else 0)
    else:
        ctl.answer(req_id, BenchState.UNSUPPORTED, [], 0, drain_ns)


def _finish(ctl: HookControl, req_id: int, seconds: float, repeat: int, model: ClusterModel,
            rng: np.random.Generator, drain_ns: int) -> None:
    cv = model.scenario.noise.jitter_cv
    times = seconds * np.exp(rng.normal(0.0, cv, repeat)) if cv > 0 else np.full(repeat, seconds)
    ctl.answer(req_id, BenchState.DONE, [max(1, round(x * 1e9)) for x in times.tolist()], 0,
               drain_ns)


def _peer_gpu(model: ClusterModel, rank: int, comm_id: int, peer: int) -> int | None:
    """The GPU of comm rank ``peer`` in one of this rank's communicators, or None if invalid."""
    index = (comm_id & 0xFFFFFFFF) - 1
    if not 0 <= index < model.comms.size or int(comm_ids(model.comms)[index]) != comm_id:
        return None
    members = model.comms.members(index)
    if rank not in members.tolist() or not 0 <= peer < len(members) or members[peer] == rank:
        return None
    return int(model.layout.gpu_of_rank[int(members[peer])])
