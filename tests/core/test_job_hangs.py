"""Hang watching over counter samples: stalls inside NCCL alarm, phases outside NCCL do not."""

from __future__ import annotations

from typing import Any

from greyhound.core.job_hangs import COUNTER_FIELDS, JobHangMonitor


def _sample(completed: list[int], inflight: list[float], comm: int = 7) -> dict[str, list[Any]]:
    n = len(completed)
    cols: dict[str, list[Any]] = {f: [0] * n for f in COUNTER_FIELDS}
    cols["rank"] = list(range(n))
    cols["comm_id"] = [comm] * n
    cols["comm_rank"] = list(range(n))
    cols["nranks"] = [n] * n
    cols["completed"] = completed
    cols["entered"] = [c + (1 if f > 0 else 0) for c, f in zip(completed, inflight, strict=True)]
    cols["inflight_s"] = inflight
    return cols


def _warm(mon: JobHangMonitor, seconds: int) -> int:
    done = 0
    for t in range(seconds * 10):
        mon.observe_iteration(0.1)
        done += 1
        mon.observe_counters(t / 10, _sample([done] * 4, [0.01, 0.0, 0.02, 0.0]))
        assert mon.check(t / 10) == []
    return done


def test_stall_inside_nccl_alarms_once_after_threshold() -> None:
    mon = JobHangMonitor(floor_s=3.0, multiple=20.0)
    done = _warm(mon, 10)
    start = 10.0
    alarms = []
    for k in range(1, 80):
        t = start + k / 10
        # Rank 2 never enters; the others wait inside the collective.
        mon.observe_counters(t, _sample([done] * 4, [k / 10, k / 10, 0.0, k / 10]))
        alarms += [(t, a) for a in mon.check(t)]
    assert len(alarms) == 1
    t, a = alarms[0]
    assert a.comm_id == 7 and a.waiting_ranks == (0, 1, 3)
    assert 3.0 <= a.stalled_s <= 3.3 and a.threshold_s == 3.0
    assert a.members == (0, 1, 2, 3)


def test_long_phase_outside_nccl_never_alarms() -> None:
    mon = JobHangMonitor(floor_s=3.0, multiple=20.0)
    done = _warm(mon, 10)
    for k in range(1, 100):  # a 10 s checkpoint with every rank outside NCCL
        t = 10.0 + k / 10
        mon.observe_counters(t, _sample([done] * 4, [0.0] * 4))
        assert mon.check(t) == []


def test_stale_samples_stop_the_watch() -> None:
    mon = JobHangMonitor(floor_s=3.0, multiple=20.0, stale_s=2.0)
    done = _warm(mon, 10)
    mon.observe_counters(10.0, _sample([done] * 4, [0.5] * 4))
    assert mon.check(30.0) == []  # the job (or its agent) is gone: not a hang


def test_state_round_trip_keeps_the_learned_threshold() -> None:
    mon = JobHangMonitor(floor_s=1.0, multiple=20.0)
    for k in range(50):
        mon.observe_iteration(0.2 + 0.001 * k)
    mon.policy.observe_recovered_pause(9.0)
    back = JobHangMonitor.from_state(mon.state_dict())
    assert back.policy.threshold_s() == mon.policy.threshold_s() == 1.5 * 9.0
    assert back.policy.typical_s() == mon.policy.typical_s()


def test_stall_with_short_calls_inside_nccl_is_not_a_hang() -> None:
    """A job held back from outside (a paced simulation, a paused consumer) shows no progress
    for a long time, but none of its calls has been inside NCCL long: not a hang."""
    mon = JobHangMonitor(floor_s=3.0, multiple=20.0)
    done = _warm(mon, 10)
    for k in range(1, 100):
        t = 10.0 + k / 10
        mon.observe_counters(t, _sample([done] * 4, [0.05, 0.05, 0.0, 0.05]))
        assert mon.check(t) == []


def test_a_long_wait_that_ended_is_learned() -> None:
    mon = JobHangMonitor(floor_s=3.0, multiple=20.0)
    done = _warm(mon, 10)
    t = 10.0
    for k in range(1, 41):  # ranks wait 4 s inside a barrier while rank 0 saves: one alarm
        t = 10.0 + k / 10
        mon.observe_counters(t, _sample([done] * 4, [0.0, k / 10, k / 10, k / 10]))
        mon.check(t)
    mon.observe_counters(t + 0.1, _sample([done + 1] * 4, [0.0] * 4))  # it completed
    assert mon.policy.threshold_s() >= 1.5 * 4.0
    for k in range(1, 41):  # the next checkpoint's barrier of the same length: no alarm
        t2 = t + 1 + k / 10
        mon.observe_counters(t2, _sample([done + 1] * 4, [0.0, k / 10, k / 10, k / 10]))
        assert mon.check(t2) == []


def test_rows_for_a_finding_include_the_waiting_ranks_other_communicators() -> None:
    mon = JobHangMonitor(floor_s=3.0, multiple=20.0)
    done = _warm(mon, 10)
    other = _sample([done] * 4, [0.0] * 4, comm=9)
    other["rank"] = [0, 1, 2, 5]  # rank 5 shares nothing with the stalled communicator
    for k in range(1, 40):
        t = 10.0 + k / 10
        mon.observe_counters(t, _sample([done] * 4, [k / 10, k / 10, 0.0, k / 10]))
        mon.observe_counters(t, other)
        found = mon.check(t)
        if found:
            break
    rows = mon.rows_for(found)
    pairs = set(zip(rows["comm_id"], rows["rank"], strict=True))
    assert {(7, r) for r in range(4)} <= pairs
    assert {(9, 0), (9, 1), (9, 2)} <= pairs and (9, 5) not in pairs


def test_rows_for_a_finding_include_every_communicator_with_a_call_in_flight() -> None:
    """The root's call need not be the longest wait: the hang event must also carry calls still
    under the threshold (a rank that joined the cascade late) and their members' other rows."""
    mon = JobHangMonitor(floor_s=3.0, multiple=20.0)
    done = _warm(mon, 10)
    late = _sample([done] * 2, [0.0, 0.0], comm=11)
    late["rank"] = [6, 8]
    elsewhere = _sample([done] * 2, [0.0, 0.0], comm=12)
    elsewhere["rank"] = [8, 9]
    untouched = _sample([done] * 2, [0.0, 0.0], comm=13)
    untouched["rank"] = [20, 21]
    found = []
    for k in range(1, 40):
        t = 10.0 + k / 10
        mon.observe_counters(t, _sample([done] * 4, [k / 10, k / 10, 0.0, k / 10]))
        late["inflight_s"] = [0.0, min(k / 10, 0.5)]  # rank 8 waits, well under the threshold
        late["entered"] = [done, done + 1]
        mon.observe_counters(t, late)
        mon.observe_counters(t, elsewhere)
        mon.observe_counters(t, untouched)
        found = mon.check(t)
        if found:
            break
    assert [f.comm_id for f in found] == [7]
    pairs = set(zip(mon.rows_for(found)["comm_id"], mon.rows_for(found)["rank"], strict=True))
    assert {(11, 6), (11, 8), (12, 8)} <= pairs
    assert not {(12, 9), (13, 20), (13, 21)} & pairs  # no member in any call in flight
    # past the row limit, the longest waits stay
    few = mon.rows_for(found, limit=4)
    assert set(few["comm_id"]) == {7}


def _gpu_sample(done: list[int], pending: list[float], comm: int = 7,
                inflight: list[float] | None = None) -> dict[str, list[Any]]:
    """Rows of an asynchronous job with GPU completion marks: hosts have returned from every
    call (inflight 0 unless given), the GPU has ``done`` calls done and its oldest pending call
    is ``pending`` seconds old (0: nothing pending)."""
    n = len(done)
    cols = _sample(done, [0.0] * n, comm)
    cols["entered"] = cols["completed"] = [d + 2 for d in done]  # the hosts ran ahead
    cols["inflight_s"] = inflight or [0.0] * n
    cols["gpu_marks"] = [1] * n
    cols["gpu_completed"] = done
    cols["gpu_pending_s"] = pending
    cols["gpu_pending_op"] = [1 if p > 0 else 0 for p in pending]
    return cols


def _warm_gpu(mon: JobHangMonitor, seconds: int) -> int:
    done = 0
    for t in range(seconds * 10):
        mon.observe_iteration(0.1)
        done += 1
        mon.observe_counters(t / 10, _gpu_sample([done] * 4, [0.08, 0.05, 0.09, 0.0]))
        assert mon.check(t / 10) == []
    return done


def test_call_pending_on_the_gpu_alarms_while_no_host_is_inside_nccl() -> None:
    mon = JobHangMonitor(floor_s=3.0, multiple=20.0)
    done = _warm_gpu(mon, 10)
    alarms = []
    for k in range(1, 80):
        t = 10.0 + k / 10
        # Rank 2 never enqueued; the others' GPUs wait in the collective, their hosts blocked
        # in a synchronisation outside NCCL.
        mon.observe_counters(t, _gpu_sample([done] * 4, [k / 10, k / 10, 0.0, k / 10]))
        alarms += mon.check(t)
    assert len(alarms) == 1
    (a,) = alarms
    assert a.comm_id == 7 and a.waiting_ranks == (0, 1, 3) and a.basis == "gpu"
    assert 3.0 <= a.stalled_s <= 3.3 and a.threshold_s == 3.0


def test_a_host_blocked_inside_nccl_with_its_gpu_idle_alarms_where_marks_exist() -> None:
    """NCCL's host waits inside a call while the GPU idles (connection set-up at run time, a
    bootstrap exchange, a stalled proxy): nothing is pending on the GPU, so the wait is the
    host's time inside the call, marks or not."""
    mon = JobHangMonitor(floor_s=3.0, multiple=20.0)
    done = _warm_gpu(mon, 10)
    alarms = []
    for k in range(1, 80):
        t = 10.0 + k / 10
        # ranks 0 and 1 inside the call (GPU idle), 2 and 3 returned long ago
        mon.observe_counters(t, _gpu_sample([done] * 4, [0.0] * 4,
                                            inflight=[k / 10, k / 10, 0.0, 0.0]))
        alarms += mon.check(t)
    assert len(alarms) == 1
    (a,) = alarms
    assert a.waiting_ranks == (0, 1) and a.basis == "gpu" and a.marks_off == ()
    assert 3.0 <= a.stalled_s <= 3.3 and a.threshold_s == 3.0 and not a.setup
    # the hosts leave the call and the GPUs finish it: over
    mon.observe_counters(18.1, _gpu_sample([done + 1] * 4, [0.0] * 4))
    assert mon.take_recovered() == [7]


def test_the_longer_of_gpu_pending_and_host_inside_a_call_counts() -> None:
    mon = JobHangMonitor(floor_s=3.0, multiple=20.0)
    done = _warm_gpu(mon, 10)
    mon.observe_counters(10.1, _gpu_sample([done] * 2, [1.0, 4.0], comm=8, inflight=[5.0, 0.5]))
    (a,) = mon.check(10.1)
    assert a.stalled_s == 5.0 and a.waiting_ranks == (0, 1)


def _setup_sample(inflight: list[float], op: int, marks: int = 0) -> dict[str, list[Any]]:
    cols = _sample([0] * len(inflight), inflight, comm=9)
    cols["last_op"] = [op if f > 0 else 1 for f in inflight]
    cols["gpu_marks"] = [marks] * len(inflight)
    return cols


def test_a_wait_inside_a_lifecycle_call_has_the_setup_allowance_and_ends_by_leaving_it() -> None:
    """Ranks reach the first init minutes apart (some load a model first): waits inside an init,
    split, shrink or destroy are judged against the set-up floor, and end when the ranks leave
    the call, even before any call completes on the new communicator."""
    mon = JobHangMonitor(floor_s=3.0, multiple=20.0, setup_floor_s=30.0)
    comm_init, comm_split = 32, 34
    for k in range(1, 200):  # 20 s inside ncclCommInitRank: under the set-up floor
        t = k / 10
        mon.observe_counters(t, _setup_sample([t, t, 0.0], comm_init))
        assert mon.check(t) == []
    mon.observe_counters(20.1, _setup_sample([0.0, 0.0, 0.0], comm_init))  # the last rank came
    assert mon.check(20.1) == [] and mon.take_recovered() == []
    assert mon.policy.threshold_s() == 3.0  # a start-up wait is no normal phase to learn from
    alarms = []
    for k in range(1, 400):  # now one rank never calls the split: past the set-up floor
        t = 30.0 + k / 10
        mon.observe_counters(t, _setup_sample([k / 10, 0.0, k / 10], comm_split))
        alarms += mon.check(t)
    (a,) = alarms
    assert a.setup and a.threshold_s == 30.0 and 30.0 <= a.stalled_s <= 30.3
    assert a.waiting_ranks == (0, 2) and a.basis == "host" and a.marks_off == (0, 1, 2)
    mon.observe_counters(80.0, _setup_sample([0.0, 0.0, 0.0], comm_split))
    assert mon.take_recovered() == [9] and mon.alarmed() == []


def test_members_without_gpu_marks_are_named_in_the_finding() -> None:
    mon = JobHangMonitor(floor_s=3.0, multiple=20.0)
    rows = _gpu_sample([5, 5, 5], [4.0, 0.0, 0.0])
    rows["gpu_marks"] = [1, 0, 1]
    mon.observe_counters(1.0, rows)
    (a,) = mon.check(1.0)
    assert a.marks_off == (1,) and a.basis == "mixed"


def test_checkpoint_with_nothing_pending_on_the_gpu_never_alarms() -> None:
    mon = JobHangMonitor(floor_s=3.0, multiple=20.0)
    done = _warm_gpu(mon, 10)
    for k in range(1, 100):
        t = 10.0 + k / 10
        mon.observe_counters(t, _gpu_sample([done] * 4, [0.0] * 4))
        assert mon.check(t) == []


def test_a_long_gpu_wait_that_ended_is_learned_and_one_that_did_not_is_not() -> None:
    mon = JobHangMonitor(floor_s=3.0, multiple=20.0)
    done = _warm_gpu(mon, 10)
    t = 10.0
    for k in range(1, 41):  # peers' barrier pends 4 s on their GPUs while rank 0 saves
        t = 10.0 + k / 10
        mon.observe_counters(t, _gpu_sample([done] * 4, [0.0, k / 10, k / 10, k / 10]))
        mon.check(t)
    # calls on another stream complete while the barrier is still the oldest pending call:
    # the wait has not ended, nothing is learned
    mon.observe_counters(t + 0.1, _gpu_sample([done + 1] * 4, [0.0, 4.1, 4.1, 4.1]))
    assert mon.policy.threshold_s() == 3.0
    mon.observe_counters(t + 0.2, _gpu_sample([done + 2] * 4, [0.0] * 4))  # it completed
    assert mon.policy.threshold_s() >= 1.5 * 4.1
    for k in range(1, 41):  # the next checkpoint's barrier of the same length: no alarm
        t2 = t + 1 + k / 10
        mon.observe_counters(t2, _gpu_sample([done + 2] * 4, [0.0, k / 10, k / 10, k / 10]))
        assert mon.check(t2) == []


def test_rows_without_marks_fall_back_to_host_time_and_say_so() -> None:
    mon = JobHangMonitor(floor_s=3.0, multiple=20.0)
    done = _warm(mon, 10)
    found = []
    for k in range(1, 40):
        t = 10.0 + k / 10
        host = _sample([done] * 4, [k / 10, k / 10, 0.0, k / 10])
        host["gpu_pending_s"] = [99.0] * 4  # never read without marks
        mon.observe_counters(t, host)
        mon.observe_counters(t, _gpu_sample([done] * 2, [k / 10, k / 10], comm=8))
        found += mon.check(t)
    assert {(f.comm_id, f.basis) for f in found} == {(7, "host"), (8, "gpu")}
    assert all(3.0 <= f.stalled_s <= 3.3 for f in found)


def _hang(mon: JobHangMonitor, done: int, start: float, seconds: float) -> float:
    """Ranks 0, 1, 3 wait inside the collective for ``seconds``; the time reached."""
    t = start
    for k in range(1, int(seconds * 10) + 1):
        t = start + k / 10
        mon.observe_counters(t, _sample([done] * 4, [k / 10, k / 10, 0.0, k / 10]))
        mon.check(t)
    return t


def test_a_reported_hang_is_over_when_its_communicator_moves_again() -> None:
    mon = JobHangMonitor(floor_s=3.0, multiple=20.0)
    done = _warm(mon, 10)
    t = _hang(mon, done, 10.0, 5.0)
    assert mon.alarmed() == [7] and mon.take_recovered() == []
    mon.observe_counters(t + 0.1, _sample([done + 1] * 4, [0.0] * 4))  # it completed
    assert mon.take_recovered() == [7] and mon.take_recovered() == []  # handed out once
    assert mon.alarmed() == []


def test_alarms_survive_a_restart_and_end_at_the_first_moving_sample() -> None:
    mon = JobHangMonitor(floor_s=3.0, multiple=20.0)
    done = _warm(mon, 10)
    t = _hang(mon, done, 10.0, 5.0)
    still = JobHangMonitor.from_state(mon.state_dict())
    still.observe_counters(t + 0.1, _sample([done] * 4, [5.1, 5.1, 0.0, 5.1]))  # still stuck
    assert still.check(t + 0.1) == [] and still.alarmed() == [7]  # not reported twice
    assert still.take_recovered() == []
    moved = JobHangMonitor.from_state(mon.state_dict())
    moved.observe_counters(t + 0.1, _sample([done + 3] * 4, [0.0] * 4))
    assert moved.take_recovered() == [7] and moved.alarmed() == []


def test_infinite_or_absurd_values_never_reach_the_threshold() -> None:
    mon = JobHangMonitor(floor_s=3.0, multiple=20.0)
    done = _warm(mon, 10)
    threshold = mon.policy.threshold_s()
    for bad in (float("inf"), float("nan"), -1.0, 0.0):
        mon.observe_iteration(bad)
    mon.observe_counters(11.0, _sample([done] * 4, [float("inf"), float("nan"), 0.0, 0.0]))
    assert mon.check(11.0) == []  # a wait that is not a number is no wait
    mon.observe_counters(11.1, _sample([done + 1] * 4, [0.0] * 4))
    assert mon.policy.threshold_s() == threshold
    state = mon.state_dict()
    state["recent"] += [float("inf")]
    state["long"] += [float("nan")]
    assert JobHangMonitor.from_state(state).policy.threshold_s() == threshold


def test_communicators_not_sampled_are_forgotten_and_their_number_bounded() -> None:
    mon = JobHangMonitor(floor_s=3.0, multiple=20.0, max_comms=10)
    for c in range(30):
        mon.observe_counters(float(c), _sample([1] * 2, [0.0] * 2, comm=c))
    gone = mon.forget(30.0, forget_s=100.0)
    assert len(mon.comms) == 10 and sorted(mon.comms) == list(range(20, 30))
    assert sorted(gone) == list(range(20))
    assert sorted(mon.forget(36.0, forget_s=10.0)) == list(range(20, 26))
