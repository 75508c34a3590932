"""The slow-localisation core on simulated profiling windows (TP2 DP4 PP2, 4 GPUs a node)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from greyhound import hookabi
from greyhound.core.slow_localization import ProfiledCalls, complete_instances, localize_slow
from greyhound.sim.model import ClusterModel
from greyhound.sim.records import NEVER_NS, RecordCodec
from greyhound.sim.scenario import parse_scenario

JOB = {"tp": 2, "dp": 4, "pp": 2, "gpus_per_node": 4, "microbatches": 4,
       "microbatch_compute_s": 0.02, "dp_allreduce_bytes": 2.0e8, "pp_activation_bytes": 1.0e7,
       "link_gbps": 100, "nvlink_gbps": 900}
DTYPE_BYTES = np.array([1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1])


def window(faults: list[dict[str, Any]], *, fault_s: float = 5.0, until_s: float = 9.0,
           from_s: float = 7.0, **job: Any) -> tuple[ProfiledCalls, float, float, dict[int, int]]:
    """The calls of [from_s, until_s) and the iteration times before and after the fault."""
    sc = parse_scenario({"name": "t", "job": {**JOB, **job}, "duration_s": 60, "seed": 3,
                         "noise": {"jitter_cv": 0.02},
                         "faults": [{**f, "start_s": fault_s, "duration_s": 100} for f in faults]})
    model = ClusterModel(sc)
    codec = RecordCodec(model.comms, 0, pid=1)
    t, recs, ranks, ends = 0.0, [], [], []
    while t < until_s:
        it = model.iteration(t)
        r, rec = codec.encode(it.blocks)
        recs.append(rec)
        ranks.append(r)
        ends.append(it.end_s)
        t = it.end_s
    rec, rank = np.concatenate(recs), np.concatenate(ranks)
    # The profiler's view: arrival and completion on each rank's GPU timeline.
    keep = (rec["gpu_start_ns"] >= from_s * 1e9) & (rec["gpu_end_ns"] != NEVER_NS)
    rec, rank = rec[keep], rank[keep]
    op = rec["op"]
    calls = ProfiledCalls(
        rank=rank, comm_id=rec["comm_id"].view(np.int64), comm_rank=rec["comm_rank"],
        nranks=rec["nranks"], seq=rec["seq"].astype(np.int64),
        op=np.array([hookabi.Op(int(o)).name.lower() for o in op]),
        nbytes=rec["count"].astype(np.int64) * DTYPE_BYTES[rec["datatype"]],
        p2p=np.isin(op, [hookabi.Op.SEND, hookabi.Op.RECV]),
        enter_ns=rec["gpu_start_ns"].astype(np.float64), exit_ns=rec["gpu_end_ns"].astype(np.float64))
    its = np.diff(ends)
    nodes = {r: int(model.layout.gpu_of_rank[r]) // 4 for r in range(16)}
    return calls, float(its[0]), float(its[-1]), nodes


def test_throttled_gpu_is_a_compute_straggler() -> None:
    calls, before, after, nodes = window([{"kind": "gpu_slow", "rank": 5, "factor": 1.5}])
    loc = localize_slow(calls, node_of_rank=nodes, before_s=before, after_s=after)
    assert (loc.kind, loc.compute_ranks, loc.comm_ids, loc.nodes) == ("compute_slow", [5], [], [1])
    assert loc.evidence["compute"][0]["p"] == pytest.approx(1.0, abs=0.05)


def test_congested_link_names_the_dp_rings_through_it() -> None:
    calls, before, after, nodes = window(
        [{"kind": "link_congestion", "nodes": [0, 1], "factor": 4.0}])
    loc = localize_slow(calls, node_of_rank=nodes, before_s=before, after_s=after)
    assert loc.kind == "comm_slow" and loc.compute_ranks == []
    assert len(loc.comm_ids) == 2 and loc.ranks == list(range(8))
    assert loc.links == [(0, 1)] and loc.nodes == [0, 1]
    assert all(g["ratio"] > 1.1 for g in loc.evidence["groups"])


def test_fault_over_before_profiling_is_transient() -> None:
    calls, before, _, nodes = window([])
    loc = localize_slow(calls, node_of_rank=nodes, before_s=before, after_s=before * 1.3)
    assert loc.kind == "none" and loc.transient and loc.ranks == []


def test_a_window_shorter_than_an_iteration_is_not_taken_for_a_recovery() -> None:
    """With 32 micro-batches a window of a fraction of an iteration repeats every micro-batch
    (1F1B's steady state): that period is no iteration time, so it cannot say the job is back
    to healthy (it once closed host-contention incidents at 64 and 256 GPUs as transient)."""
    _, before, _, _ = window([], microbatches=32)
    for share in (0.3, 0.8):
        part, _, _, nodes = window([], until_s=7.0 + share * before, microbatches=32)
        loc = localize_slow(part, node_of_rank=nodes, before_s=before, after_s=before * 1.3)
        assert not loc.transient, loc.evidence
        assert loc.evidence["iteration_profiled_s"] is None
        assert loc.evidence["subiteration_period_s"] < 0.2 * before


def test_partial_instances_at_the_window_edge_are_dropped() -> None:
    calls, _, _, _ = window([])
    cut = calls.take(~((calls.rank == 3) & (calls.enter_ns == calls.enter_ns[calls.rank == 3].max())))
    keep = complete_instances(cut)
    assert keep.sum() < len(cut) and keep[cut.p2p].all()


def _busy_outside(shares: dict[int, float], *, ranks: int = 8, calls: int = 12) -> ProfiledCalls:
    """One communicator of ``ranks`` members, each calling it every millisecond and spending
    ``shares[r]`` (default 0.36) of the time between calls outside NCCL."""
    period = 1_000_000.0
    rank = np.repeat(np.arange(ranks), calls)
    seq = np.tile(np.arange(calls), ranks)
    enter = seq * period
    inside = np.array([1.0 - shares.get(int(r), 0.36) for r in rank]) * period
    n = len(rank)
    return ProfiledCalls(
        rank=rank, comm_id=np.full(n, 77, np.int64), comm_rank=rank.copy(),
        nranks=np.full(n, ranks), seq=seq.astype(np.int64), op=np.full(n, "allreduce"),
        nbytes=np.full(n, 1 << 20, np.int64), p2p=np.zeros(n, bool),
        enter_ns=enter.astype(np.float64), exit_ns=(enter + inside).astype(np.float64))


def test_only_hosts_that_stand_out_like_the_worst_are_named() -> None:
    """A contended host's ranks spend far more time outside NCCL than their peers (0.69 vs
    0.36); peers a window catches at another pipeline phase differ by a little (0.40), which
    alone would pass the 10% rule: named are only excesses comparable to the job's largest."""
    from greyhound.core.slow_localization import _slow_outside_nccl

    named, _ = _slow_outside_nccl(_busy_outside({3: 0.69, 5: 0.40, 6: 0.40}), 0.10)
    assert named == [3]
    named, _ = _slow_outside_nccl(_busy_outside({5: 0.40, 6: 0.40}), 0.10)
    assert named == [5, 6]  # alone, the small excess is the largest: still named
    named, _ = _slow_outside_nccl(_busy_outside({2: 0.69, 3: 0.66}), 0.10)
    assert named == [2, 3]  # two contended hosts alike are both named


def test_a_host_is_named_only_when_its_excess_explains_the_slowdown() -> None:
    """Localising a 25% slowdown (1.0 -> 1.25 ms an iteration): a contended host's ranks spend
    the added time outside NCCL (0.69 of it against 0.36), which explains it; peers that a
    window catches at another phase (0.40) differ by 4% of the iteration, far under the 20% the
    slowdown added, and are not blamed for it."""
    nodes = {r: f"n{r}" for r in range(8)}
    one = localize_slow(_busy_outside({3: 0.69, 5: 0.40}), node_of_rank=nodes, before_s=0.8e-3,
                        after_s=1.0e-3)
    assert one.compute_ranks == [3]
    none = localize_slow(_busy_outside({5: 0.40, 6: 0.40}), node_of_rank=nodes,
                         before_s=0.8e-3, after_s=1.0e-3)
    assert none.compute_ranks == [], none.evidence.get("outside_nccl")
    # a slowdown that small is what such an excess explains: named
    small = localize_slow(_busy_outside({5: 0.40, 6: 0.40}), node_of_rank=nodes,
                          before_s=0.96e-3, after_s=1.0e-3)
    assert small.compute_ranks == [5, 6]
