"""The cluster model's records, faults and plans behave like a real job's would."""

from __future__ import annotations

import numpy as np
import pytest

from greyhound.core.plans import MicrobatchPlan, PlanError, RestartPlan, SwapNodesPlan
from greyhound.sim.events import CommKind, Op
from greyhound.sim.model import ClusterModel
from greyhound.sim.offline import run_offline
from tests.sim.helpers import job, scenario

J = job(tp=2, dp=4, pp=2, gpus_per_node=2, microbatches=8, microbatch_compute_s=0.1,
        dp_allreduce_bytes=1e9, pp_activation_bytes=1e7, optimizer_s=0.01,
        link_latency_us=5.0, nvlink_latency_us=1.0)


def test_records_are_complete_and_consistent() -> None:
    model = ClusterModel(scenario(J))
    it = model.iteration(10.0)
    ev = it.events()
    assert np.all(ev.gpu_end >= ev.gpu_start) and np.all(ev.gpu_start >= 10.0)
    assert ev.gpu_end.max() <= it.end_s + 1e-9
    # Every member of a collective has the same seq and leaves it at the same time.
    for comm in np.unique(ev.comm[ev.op == Op.ALLREDUCE]):
        sel = (ev.comm == comm) & (ev.op == Op.ALLREDUCE)
        members = model.comms.members(int(comm))
        for seq in np.unique(ev.seq[sel]):
            one = sel & (ev.seq == seq)
            assert sorted(ev.rank[one]) == sorted(members)
            assert np.ptp(ev.gpu_end[one]) == 0
    # Each send has a matching receive with the same completion time.
    sends, recvs = ev.op == Op.SEND, ev.op == Op.RECV
    assert sends.sum() == recvs.sum() == 2 * 2 * 4 * 2 * 1  # fwd+bwd x m x DP x TP x links
    pairs_s = sorted(zip(ev.rank[sends], ev.peer[sends], ev.gpu_end[sends], strict=True))
    pairs_r = sorted(zip(ev.peer[recvs], ev.rank[recvs], ev.gpu_end[recvs], strict=True))
    assert pairs_s == pairs_r
    # Per-(rank, comm) sequence numbers are 0..n-1 in the first iteration.
    keys = ev.rank.astype(np.int64) * 10_000 + ev.comm
    for key in np.unique(keys):
        assert sorted(ev.seq[keys == key]) == list(range(int((keys == key).sum())))
    assert model.comms.kind(int(ev.comm[sends][0])) is CommKind.PP


def test_sequence_numbers_continue_across_iterations() -> None:
    model = ClusterModel(scenario(J))
    first = model.iteration(0.0).events()
    second = model.iteration(1.0).events()
    dp = second.op == Op.ALLREDUCE
    assert second.seq[dp].min() >= 1
    assert second.seq.max() > first.seq.max()


def test_hosts_enqueue_the_iteration_up_front_and_the_gpu_follows() -> None:
    """Asynchronous NCCL: each host issues the whole iteration within host_fraction of its GPU
    time, microseconds per call, in the order its GPU then runs the calls, and never after the
    GPU got there; the iteration's GPU work takes ten times as long."""
    model = ClusterModel(scenario(J))
    it = model.iteration(10.0)
    ev = it.events()
    assert np.allclose(ev.host_return - ev.host_enter, 5e-6)
    assert np.all(ev.gpu_start >= ev.host_enter) and np.all(ev.gpu_end >= ev.gpu_start)
    assert ev.host_enter.min() == pytest.approx(10.0)
    for r in range(16):
        mine = ev.rank == r
        host, gpu = ev.host_enter[mine], ev.gpu_start[mine]
        order = np.argsort(host)
        assert np.all(np.diff(host[order]) >= 5e-6 - 1e-12)  # one call at a time
        assert np.all(np.diff(gpu[order]) >= 0)  # the GPU runs them in enqueue order
        assert host.max() - 10.0 < 0.15 * it.duration_s < gpu.max() - 10.0


def test_a_slow_gpu_reaches_its_collectives_last_while_its_host_keeps_pace() -> None:
    model = ClusterModel(scenario(J, [{"kind": "gpu_slow", "rank": 3, "start_s": 0,
                                       "factor": 2.0}]))
    ev = model.iteration(0.0).events()
    tp = (ev.op == Op.ALLREDUCE) & (ev.nbytes == int(J["pp_activation_bytes"]))
    comm = ev.comm[tp & (ev.rank == 3)][0]
    one = tp & (ev.comm == comm) & (ev.seq == 0)
    assert ev.rank[one][np.argmax(ev.gpu_start[one])] == 3
    assert np.ptp(ev.host_enter[one]) == 0  # both hosts enqueued it at the same moment
    group = tp & (ev.comm == comm)
    slow, peer = (group & (ev.rank == r) for r in (3, 2))
    assert np.array_equal(ev.host_enter[slow], ev.host_enter[peer])
    assert np.all(ev.gpu_start[slow] > ev.gpu_start[peer])


@pytest.mark.parametrize(("factor", "slower"), [(5.0, False), (30.0, True)])
def test_cpu_contention_matters_only_once_the_host_falls_behind(factor: float,
                                                               slower: bool) -> None:
    """Node 1 (ranks 2, 3) under contention: at 5x its hosts still run ahead (host_fraction 0.1),
    at 30x they fall behind and the node's GPUs reach each all-reduce when their host enqueues
    it, late, which slows the whole job."""
    healthy = ClusterModel(scenario(J)).iteration(0.0)
    model = ClusterModel(scenario(J, [{"kind": "cpu_contention", "node": 1, "start_s": 0,
                                       "factor": factor}]))
    it = model.iteration(0.0)
    ev = it.events()
    assert (it.duration_s > 1.5 * healthy.duration_s) is slower
    if not slower:
        assert it.duration_s == pytest.approx(healthy.duration_s)
        return
    node = np.isin(ev.rank, [2, 3])
    tp = (ev.op == Op.ALLREDUCE) & (ev.nbytes == int(J["pp_activation_bytes"]))
    waited = ev.gpu_start[node & tp] == ev.host_enter[node & tp]
    assert waited.mean() > 0.9
    assert np.allclose(ev.host_return[node] - ev.host_enter[node], 30 * 5e-6)


@pytest.mark.parametrize("kind", ["hang_not_entered", "hang_inconsistent", "hang_hardware"])
def test_hangs_freeze_the_job_and_restart_clears_them(kind: str) -> None:
    model = ClusterModel(scenario(J, [{"kind": kind, "rank": 5, "start_s": 2.0}]))
    t = 0.0
    while True:
        it = model.iteration(t)
        if it.hung:
            break
        t = it.end_s
    ev = it.events()
    stuck = np.isfinite(ev.gpu_start) & ~np.isfinite(ev.gpu_end)
    assert stuck.any()
    victim = ev.rank == 5
    # Hosts never wait inside NCCL: every host other than a not-entered victim's enqueued the
    # whole iteration (and then waits in its synchronisation).
    others = ~victim if kind == "hang_not_entered" else np.ones(len(victim), bool)
    assert np.all(np.isfinite(ev.host_enter[others]))
    if kind == "hang_not_entered":
        assert (victim & ~np.isfinite(ev.gpu_start)).any()
        never = victim & ~np.isfinite(ev.host_enter)
        assert never.any() and not (never & np.isfinite(ev.gpu_start)).any()
    elif kind == "hang_inconsistent":
        assert (victim & (ev.op == Op.ALLGATHER)).any() or (victim & stuck).any()
    else:
        assert (victim & stuck).any()
    assert model.iteration(t + 100).hung
    plan = RestartPlan(replace_gpus=(5,)) if kind == "hang_hardware" else RestartPlan()
    assert model.apply_plan(plan) == 1800.0
    assert not model.iteration(t + 2000).hung


def test_offline_series_ends_at_a_hang_and_is_reproducible() -> None:
    s = scenario(J, [{"kind": "hang_hardware", "rank": 1, "start_s": 5.0}], seed=4,
                 noise={"jitter_cv": 0.02, "gc_prob": 0.1})
    a, b = list(run_offline(s)), list(run_offline(s))
    assert a == b and 4.0 < sum(a) <= 5.0 + max(a)
    assert np.std(a) > 0


def test_slow_faults_start_and_end_in_virtual_time() -> None:
    s = scenario(J, [{"kind": "link_congestion", "nodes": [0, 1], "start_s": 5, "duration_s": 5,
                      "factor": 8.0}], duration_s=20)
    xs = np.array(list(run_offline(s)))
    t = np.concatenate([[0.0], np.cumsum(xs)[:-1]])
    during, outside = xs[(t >= 5) & (t < 10)], xs[(t < 4.5) | (t >= 10.5)]
    assert during.min() > 1.5 * outside.max()


def test_plans_change_the_layout_and_cost_time() -> None:
    model = ClusterModel(scenario(J))
    assert model.apply_plan(MicrobatchPlan((1, 3, 2, 2))) == 0.5
    assert model.apply_plan(SwapNodesPlan(((0, 3),))) == 60.0
    assert model.layout.gpu_of_rank[0] == 6 and model.layout.gpu_of_rank[6] == 0
    ev = model.iteration(0.0).events()
    assert set(ev.gpu[ev.rank == 0]) == {6}
    with pytest.raises(PlanError):
        model.apply_plan(MicrobatchPlan((1, 1, 1, 1)))


def test_node_role_swap_moves_a_congested_dp_link_to_pp() -> None:
    """Fig. 11: the congested link 3-4 carries DP traffic; swapping nodes 2 and 3 moves it to PP."""
    j = job(tp=1, dp=4, pp=2, gpus_per_node=1, microbatches=8, microbatch_compute_s=0.1,
            dp_allreduce_bytes=4e9, pp_activation_bytes=2e7)
    faults = [{"kind": "link_congestion", "nodes": [5, 6], "start_s": 0, "factor": 8.0}]
    healthy = ClusterModel(scenario(j)).iteration(0.0).duration_s
    model = ClusterModel(scenario(j, faults))
    slow = model.iteration(0.0).duration_s
    model.apply_plan(SwapNodesPlan(((2, 5),)))
    fixed = model.iteration(1.0).duration_s
    assert slow > 1.5 * healthy and fixed < 1.1 * healthy
