"""The profiling window on the GPU timeline: a compute straggler whose host enqueues every
collective with its peers is named from its GPU start times; calls the hook could not time are
excluded without blaming anyone; a host-only job is still read on host time."""

from __future__ import annotations

import numpy as np

from greyhound.core.contribution import CollectiveObservation
from greyhound.core.slow_localization import localize_slow
from services.analyzer.profiling import ProfileBuffer, WindowRule
from services.common.bus.contract import CollectiveBatch
from tests.core.test_contribution import DP_BASE, _job

T0 = 1_700_000_000_000_000_000  # wall-clock ns
TP, DP = 4, 8


def _batch(obs: CollectiveObservation, *, gpu: bool,
           untimed: np.ndarray | None = None) -> CollectiveBatch:
    """The observation as an agent publishes it from an asynchronous job: every host enqueues
    the k-th call of an iteration at the same instant (its arrival and completion are on the
    GPU); with gpu=False, a host-only job whose host times are the arrivals."""
    dp = obs.comm_id >= DP_BASE
    iteration = np.where(dp, obs.seq, obs.seq // 2)
    k = np.where(dp, 2, obs.seq % 2)
    host_enter = T0 + iteration * 1_000_000_000 + k * 1000
    arrive, done = T0 + obs.enter_ns.astype(np.int64), T0 + obs.exit_ns.astype(np.int64)
    cols = {"rank": obs.rank, "comm_id": obs.comm_id,
            "comm_rank": np.where(dp, obs.rank // TP, obs.rank % TP),
            "nranks": np.where(dp, DP, TP), "seq": obs.seq, "op": np.where(dp, 1, 3),
            "count": obs.nbytes // 4, "dtype": np.full(len(obs.rank), 7),
            "peer": np.full(len(obs.rank), -1)}
    if gpu:
        timed = np.ones(len(obs.rank), bool) if untimed is None else ~untimed
        cols |= {"enter_ns": host_enter, "exit_ns": host_enter + 20_000,
                 "gpu_start_ns": np.where(timed, arrive, 0), "gpu_end_ns": np.where(timed, done, 0)}
    else:
        zero = np.zeros(len(obs.rank), np.int64)
        cols |= {"enter_ns": arrive, "exit_ns": done, "gpu_start_ns": zero, "gpu_end_ns": zero}
    return CollectiveBatch(job_id="j", agent_id="a", ts=T0 / 1e9,
                           **{c: np.asarray(v).tolist() for c, v in cols.items()})


def _buffer(batch: CollectiveBatch) -> ProfileBuffer:
    buf = ProfileBuffer("j", frozenset(range(TP * DP)), opened_ts=T0 / 1e9)
    buf.add(batch)
    return buf


def _nodes() -> dict[int, int]:
    return {r: r // TP for r in range(TP * DP)}


def test_straggler_named_from_gpu_starts_while_hosts_enter_together() -> None:
    obs = _job(1, tp=TP, dp=DP, slow_rank={13: 1.3})
    batch = _batch(obs, gpu=True)
    first = [e for r, e, s, c in zip(batch.rank, batch.enter_ns, batch.seq, batch.comm_id,
                                     strict=True) if s == 4 and c < DP_BASE]
    assert len(set(first)) == 1  # one TP call: every rank's host entered it at the same ns
    buf = _buffer(batch)
    calls, timeline = buf.window()
    assert timeline.summary() == {"basis": "gpu", "gpu_rows": len(obs.rank),
                                  "host_only_rows": 0, "excluded_rows": 0}
    assert buf.ready(WindowRule(min_rows=16))
    loc = localize_slow(calls, node_of_rank=_nodes(), before_s=0.1, after_s=0.13)
    assert (loc.kind, loc.compute_ranks, loc.comm_ids) == ("compute_slow", [13], [])


def test_untimed_calls_are_excluded_and_their_gaps_blame_no_one() -> None:
    """Rank 6's DP all-reduces were never timed: they are left out, so are those DP instances
    of its group (incomplete), and the gaps that would span them (its group's next TP call)."""
    obs = _job(2, tp=TP, dp=DP, slow_rank={21: 1.3})
    untimed = (obs.rank == 6) & (obs.comm_id >= DP_BASE)
    calls, timeline = _buffer(_batch(obs, gpu=True, untimed=untimed)).window()
    assert timeline.summary() == {"basis": "gpu", "gpu_rows": len(obs.rank) - int(untimed.sum()),
                                  "host_only_rows": 0, "excluded_rows": int(untimed.sum())}
    loc = localize_slow(calls, node_of_rank=_nodes(), before_s=0.1, after_s=0.13)
    assert (loc.kind, loc.compute_ranks) == ("compute_slow", [21])


def test_host_only_job_is_read_on_host_time() -> None:
    obs = _job(3, tp=TP, dp=DP, slow_rank={5: 1.3})
    calls, timeline = _buffer(_batch(obs, gpu=False)).window()
    assert timeline.basis == "host" and timeline.host_only_rows == len(obs.rank)
    loc = localize_slow(calls, node_of_rank=_nodes(), before_s=0.1, after_s=0.13)
    assert (loc.kind, loc.compute_ranks) == ("compute_slow", [5])


def _calls(comm: int, nranks: int, times_s: list[tuple[float, float]]) -> dict[str, list[int]]:
    """One collective instance per (start, end) on ``nranks`` ranks, GPU-timed."""
    cols: dict[str, list[int]] = {c: [] for c in (
        "rank", "comm_id", "comm_rank", "nranks", "seq", "op", "count", "dtype", "peer",
        "enter_ns", "exit_ns", "gpu_start_ns", "gpu_end_ns")}
    for seq, (a, b) in enumerate(times_s):
        for r in range(nranks):
            start, end = T0 + round(a * 1e9), T0 + round(b * 1e9)
            for c, v in (("rank", r), ("comm_id", comm), ("comm_rank", r), ("nranks", nranks),
                         ("seq", seq), ("op", 1), ("count", 1024), ("dtype", 7), ("peer", -1),
                         ("enter_ns", start - 500_000_000), ("exit_ns", start - 499_000_000),
                         ("gpu_start_ns", start), ("gpu_end_ns", end)):
                cols[c].append(v)
    return cols


def test_a_window_spans_the_slow_iteration_before_it_is_ready() -> None:
    """Issue 23: iterations of 2.3 s (a congested link slows the DP all-reduce, once an
    iteration): 2.1 s of TP calls meet the max_data_s rule (one complete instance of every
    communicator seen) while the slow DP all-reduce has not completed once; the window waits
    for min_iterations of the detected iteration time, which brings it in."""
    tp = _calls(11, 4, [(0.1 * i, 0.1 * i + 0.01) for i in range(22)])
    buf = ProfileBuffer("j", frozenset(range(4)), opened_ts=T0 / 1e9)
    buf.add(CollectiveBatch(job_id="j", agent_id="a", ts=T0 / 1e9, **tp))
    rule = WindowRule()
    assert buf.ready(rule)  # the rule alone: ready, and blind to the DP all-reduce
    assert not buf.ready(rule, iteration_s=2.3)
    later = _calls(11, 4, [(2.2 + 0.1 * i, 2.21 + 0.1 * i) for i in range(8)])
    dp = _calls(22, 4, [(0.6, 2.95)])  # the slow all-reduce, completed at 2.95 s
    for cols in (later, dp):
        buf.add(CollectiveBatch(job_id="j", agent_id="a", ts=T0 / 1e9, **cols))
    assert buf.ready(rule, iteration_s=2.3)
    calls = buf.calls()
    assert set(np.unique(calls.comm_id).tolist()) == {11, 22}
