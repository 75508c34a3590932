"""Hang diagnosis from counters sampled on an asynchronous job: hosts enqueue and run ahead to
their once-per-iteration synchronisation, GPUs execute in order, and a hung collective leaves no
host thread inside NCCL. Entered comes from the host, completed and busy from the GPU marks."""

from __future__ import annotations

import numpy as np
import pytest

from greyhound.core.hang_counters import NO_OP, SampledCounters, diagnosis_inputs
from greyhound.core.hang_diagnosis import HangDiagnosis, diagnose_hang

S = 1_000_000_000
DP_BASE = 100
STEPS = 3  # per iteration: TP, TP, DP


def _play(tp: int = 4, dp: int = 4, iters: int = 6, stop: frozenset[tuple[int, int]] = frozenset(),
          wrong: frozenset[tuple[int, int]] = frozenset(),
          dead: frozenset[tuple[int, int]] = frozenset(),
          dead_blocks_all: bool = False) -> tuple[SampledCounters, int]:
    """Run every rank's program [TP, TP, DP] x iters asynchronously until nothing moves.

    A host enqueues (1 us a call) up to the end of its iteration, then waits for its GPU to
    finish everything it enqueued. A GPU runs its calls in order; a collective instance
    completes when every member's GPU has reached it with the same op. stop: (rank, step) the
    host never enqueues; wrong: enqueued as AllGather; dead: that rank's GPU never completes it
    (nor does anyone's when dead_blocks_all). Returns the counters sampled 60 s later.
    """
    n = tp * dp
    program = [[r // tp if k % STEPS < 2 else DP_BASE + r % tp for k in range(STEPS * iters)]
               for r in range(n)]
    members: dict[int, list[int]] = {}
    for r in range(n):
        for c in sorted(set(program[r])):
            members.setdefault(c, []).append(r)
    host = [0] * n  # calls enqueued
    gpu = [0] * n  # calls done on the GPU
    enq: dict[tuple[int, int], tuple[str, int]] = {}  # (rank, step) -> (op, enqueue ns)
    clock = 0
    moved = True
    while moved:
        moved = False
        for r in range(n):
            while host[r] < len(program[r]) and (r, host[r]) not in stop:
                if host[r] % STEPS == 0 and host[r] > 0 and gpu[r] < host[r]:
                    break  # the iteration's synchronisation
                clock += 1000
                enq[r, host[r]] = ("AllGather" if (r, host[r]) in wrong else "AllReduce", clock)
                host[r] += 1
                moved = True
        for c, ms in members.items():
            steps = [gpu[r] for r in ms]
            if any(s >= host[r] or program[r][s] != c for r, s in zip(ms, steps, strict=True)):
                continue  # some member's GPU is not at this communicator's next call
            if len({enq[r, s][0] for r, s in zip(ms, steps, strict=True)}) > 1:
                continue
            stuck = [r for r, s in zip(ms, steps, strict=True) if (r, s) in dead]
            if stuck and dead_blocks_all:
                continue
            clock += 1000
            for r in ms:
                if r not in stuck:
                    gpu[r] += 1
                    moved = True
    now = clock + 60 * S
    cols: dict[str, list[object]] = {k: [] for k in SampledCounters.__slots__}
    for c, ms in sorted(members.items()):
        for r in ms:
            mine = [k for k in range(len(program[r])) if program[r][k] == c]
            entered = [k for k in mine if k < host[r]]
            done = [k for k in mine if k < gpu[r]]
            pending = [k for k in entered if k >= gpu[r]]
            newest = enq[r, entered[-1]] if entered else (NO_OP, 0)
            first = pending[0] if pending else None
            row = {"comm_id": c, "rank": r, "calls_entered": len(entered),
                   "calls_completed": len(entered), "seq_entered": len(entered),
                   "seq_completed": len(entered), "inflight_s": 0.0, "last_op": newest[0],
                   "last_count": 1 << 20, "last_dtype": 7, "gpu_marks": True,
                   "gpu_seq_completed": len(done),
                   "gpu_pending_s": (now - enq[r, first][1]) / S if first is not None else 0.0,
                   "gpu_pending_seq": mine.index(first) + 1 if first is not None else 0,
                   "gpu_pending_op": enq[r, first][0] if first is not None else NO_OP,
                   "gpu_pending_count": (1 << 20) if first is not None else 0,
                   "gpu_pending_dtype": 7 if first is not None else 0}
            for k, v in row.items():
                cols[k].append(v)
    return SampledCounters(**cols), now


def _diagnose(sample: SampledCounters, now: int, stalled_s: float = 50.0) -> list[HangDiagnosis]:
    counters, last = diagnosis_inputs(sample, now_ns=now, stalled_s=stalled_s)
    return diagnose_hang(counters, last, now_ns=now, stall_ns=int(stalled_s * S / 2))


def test_no_host_is_inside_nccl_and_hosts_ran_past_the_hung_call() -> None:
    sample, _ = _play(wrong=frozenset({(9, 4)}))
    assert not np.any(sample.inflight_s) and np.all(sample.calls_completed == sample.calls_entered)
    tp2 = sample.comm_id == 2
    # every member of the hung TP group enqueued past seq 4 (its next TP call or the DP call)
    # before blocking in its synchronisation; the GPUs are stuck at seq 4
    assert np.all(sample.gpu_pending_seq[tp2] == 4)
    assert np.all(sample.seq_entered[tp2] >= 4) and np.any(sample.seq_entered[sample.rank == 9] > 2)


def test_healthy_finished_job_has_no_hang() -> None:
    sample, now = _play()
    assert not np.any(sample.gpu_pending_s)
    assert _diagnose(sample, now) == []


def test_not_entered_names_the_rank_whose_host_never_enqueued() -> None:
    sample, now = _play(stop=frozenset({(6, 8)}))  # rank 6 never enqueues its 3rd DP all-reduce
    diags = _diagnose(sample, now)
    assert {d.kind for d in diags} == {"hang_not_entered"}
    assert all(d.ranks == [6] for d in diags)
    dp = [d for d in diags if d.comm_id == DP_BASE + 2]
    assert len(dp) == 1 and dp[0].seq == 2 and dp[0].op == "AllReduce"


def test_inconsistent_compares_the_pending_calls_not_the_hosts_newest() -> None:
    sample, now = _play(wrong=frozenset({(9, 4)}))  # rank 9: AllGather at its 5th step (TP)
    diags = _diagnose(sample, now)
    assert [(d.kind, d.ranks, d.comm_id, d.seq, d.op) for d in diags] == [
        ("hang_inconsistent", [9], 2, 3, "AllReduce")]
    assert diags[0].evidence["their_ops"] == ["AllGather"]


def test_hardware_names_the_gpu_that_never_completes() -> None:
    sample, now = _play(dead=frozenset({(3, 5)}))
    diags = _diagnose(sample, now)
    assert {d.kind for d in diags} == {"hang_hardware"}
    assert all(d.ranks == [3] for d in diags)
    assert diags[0].comm_id == DP_BASE + 3 and diags[0].seq == 1


def test_hardware_with_every_member_pending_is_not_localised() -> None:
    sample, now = _play(dead=frozenset({(10, 4)}), dead_blocks_all=True)
    (d,) = _diagnose(sample, now)
    assert d.kind == "hang_hardware" and d.comm_id == 2 and d.ranks == [8, 9, 10, 11]
    assert d.evidence["localized"] == 0


def test_calls_queued_behind_a_hung_one_are_symptoms() -> None:
    """Rank 1 never enqueues its 2nd iteration's first TP call. Its TP peers enqueued their DP
    all-reduce behind the hung TP call before synchronising: their GPUs never reach it, so the
    DP groups they are missing from are symptoms, not hardware hangs of every member."""
    sample, now = _play(iters=3, stop=frozenset({(1, 3)}))
    queued = (sample.rank == 0) & (sample.comm_id == DP_BASE)
    assert sample.seq_entered[queued] == 2 and sample.gpu_seq_completed[queued] == 1
    counters, _ = diagnosis_inputs(sample, now_ns=now, stalled_s=50.0)
    busy = {(int(c), int(r)) for c, r, b in zip(counters.comm_id, counters.rank,
                                                   np.asarray(counters.in_call), strict=True) if b}
    assert (0, 0) in busy and (DP_BASE, 0) not in busy and (DP_BASE, 4) in busy
    diags = _diagnose(sample, now)
    assert {(d.kind, tuple(d.ranks)) for d in diags} == {("hang_not_entered", (1,))}
    assert {d.comm_id for d in diags} == {0, DP_BASE + 1}
    assert {DP_BASE, DP_BASE + 2, DP_BASE + 3} <= set(diags[0].evidence["symptom_comms"])


def test_random_single_faults_find_their_root() -> None:
    rng = np.random.default_rng(7)
    kinds = {"stop": "hang_not_entered", "wrong": "hang_inconsistent", "dead": "hang_hardware"}
    for _ in range(24):
        tp, dp = int(rng.choice([2, 4, 8])), int(rng.choice([2, 3, 4, 8]))
        rank, step = int(rng.integers(tp * dp)), int(rng.integers(1, 15))
        fault = str(rng.choice(list(kinds)))
        sample, now = _play(tp=tp, dp=dp, **{fault: frozenset({(rank, step)})})
        diags = _diagnose(sample, now)
        case = (tp, dp, fault, rank, step, diags)
        assert diags, case
        assert {d.kind for d in diags} == {kinds[fault]}, case
        assert {r for d in diags for r in d.ranks} == {rank}, case


def test_host_only_rows_keep_host_semantics() -> None:
    """Without marks, a rank inside its NCCL call is the one pending (synchronous NCCL)."""
    n = 4
    sample = SampledCounters(
        comm_id=[5] * n, rank=list(range(n)), calls_entered=[10, 10, 9, 10],
        calls_completed=[9, 9, 9, 9], seq_entered=[10, 10, 9, 10], seq_completed=[9] * n,
        inflight_s=[30.0, 30.0, 0.0, 30.0], last_op=["allreduce"] * n, last_count=[8] * n,
        last_dtype=[7] * n, gpu_marks=[False] * n, gpu_seq_completed=[0] * n,
        gpu_pending_s=[0.0] * n, gpu_pending_seq=[0] * n, gpu_pending_op=[NO_OP] * n,
        gpu_pending_count=[0] * n, gpu_pending_dtype=[0] * n)
    assert sample.basis() == "host"
    (d,) = _diagnose(sample, 100 * S, stalled_s=30.0)
    assert d.kind == "hang_not_entered" and d.ranks == [2]


def test_mismatched_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="equal lengths"):
        SampledCounters(
            comm_id=[1, 2], rank=[0], calls_entered=[0], calls_completed=[0], seq_entered=[0],
            seq_completed=[0], inflight_s=[0.0], last_op=["none"], last_count=[0],
            last_dtype=[0], gpu_marks=[True], gpu_seq_completed=[0], gpu_pending_s=[0.0],
            gpu_pending_seq=[0], gpu_pending_op=["none"], gpu_pending_count=[0],
            gpu_pending_dtype=[0])
