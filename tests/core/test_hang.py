import numpy as np
import pytest

from greyhound.core.hang import HangPolicy, HangWatch


def _run(watch, durations, start=0.0, tick=0.5, stall_after=None, until=None):
    """Drive the watch: one completion per iteration, checks every `tick` seconds."""
    alarms = []
    now = start
    for i, d in enumerate(durations):
        end = now + d
        while now + tick < end:
            now += tick
            a = watch.check(now)
            if a:
                alarms.append((i, now, a))
        now = end
        if stall_after is not None and i >= stall_after:
            break
        watch.observe(now, i + 1)
        watch.policy.observe_iteration(d)
    if until is not None:
        while now < until:
            now += tick
            a = watch.check(now)
            if a:
                alarms.append((-1, now, a))
    return alarms, now


def test_threshold_is_floor_multiple_or_learned_allowance():
    p = HangPolicy(floor_s=10.0, multiple=20.0, margin=1.5)
    assert p.threshold_s() == 10.0
    for _ in range(50):
        p.observe_iteration(2.0)
    assert p.threshold_s() == pytest.approx(40.0)
    p.observe_iteration(200.0)  # checkpoint: remembered as a long normal phase
    assert p.threshold_s() == pytest.approx(300.0)
    assert p.typical_s() == pytest.approx(2.0)


def test_stall_alarms_once_within_twice_the_threshold():
    rng = np.random.default_rng(0)
    watch = HangWatch(HangPolicy(floor_s=5.0, multiple=20.0))
    durations = list(0.3 * np.exp(rng.normal(0, 0.05, 200)))
    alarms, stop = _run(watch, durations, stall_after=150, until=None)
    assert alarms == []
    threshold = watch.policy.threshold_s()
    t0 = stop
    alarms, _ = _run(watch, [], start=t0, until=t0 + 3 * threshold)
    assert len(alarms) == 1
    _, when, alarm = alarms[0]
    assert threshold < when - alarm.since_s <= 2 * threshold


def test_recurring_checkpoint_does_not_alarm_after_the_first():
    rng = np.random.default_rng(1)
    durations = list(1.0 * np.exp(rng.normal(0, 0.03, 600)))
    for i in (100, 300, 500):
        durations[i] = 90.0  # checkpoint save, longer than floor and 20 x 1 s
    watch = HangWatch(HangPolicy(floor_s=60.0, multiple=20.0))
    alarms, _ = _run(watch, durations)
    # The first save is unknown and alarms; once it completed, the later ones are normal.
    assert [i for i, _, _ in alarms] == [100]


def test_checkpoint_shorter_than_floor_never_alarms():
    rng = np.random.default_rng(2)
    durations = list(0.02 * np.exp(rng.normal(0, 0.05, 3000)))
    durations[1000] = 45.0
    watch = HangWatch(HangPolicy(floor_s=60.0))
    alarms, _ = _run(watch, durations, tick=0.25)
    assert alarms == []
