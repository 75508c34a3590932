"""The healthy level a stream learns is not a slowdown that began inside the warm-up (issue 23:
the paper demo learned its first weak fault as healthy, found it only with the second, and
missed a later weak one)."""

import numpy as np

from greyhound.core.detector import Detection, detect_series

HEALTHY = 0.605


def _demo_like(seed: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The paper demo's job level by virtual seconds (scenarios/paper-256.yaml as it was with 4
    micro-batches per DP group, where the bug showed): healthy 0.605 s,
    fault 1 (x1.19) from 20 s inside the 48-iteration warm-up, fault 2 (+52%) on top from 70 s
    and alone to 180 s, fault 3 (+52%) 200-290 s, the weak fault 4 (x1.2) 305-385 s. Jitter 2%
    as the scenario's. Returns the iteration times and each fault's span in iterations."""
    rng = np.random.default_rng(seed)
    plan = [(20, 1.0), (70, 1.19), (180, 1.52), (200, 1.0), (290, 1.52), (305, 1.0),
            (385, 1.2), (460, 1.0)]
    times: list[float] = []
    starts: dict[float, int] = {}
    clock, piece = 0.0, 0
    while piece < len(plan):
        end, factor = plan[piece]
        if clock >= end:
            piece += 1
            continue
        starts.setdefault(plan[piece - 1][0] if piece else 0.0, len(times))
        x = HEALTHY * factor * (1.0 + 0.02 * rng.standard_normal())
        times.append(x)
        clock += x
    faults = [(starts[20], starts[180]), (starts[200], starts[290]), (starts[305], starts[385])]
    return np.asarray(times), faults


def _onsets(dets: list[Detection]) -> list[Detection]:
    return [d for d in dets if d.kind == "slowdown" and d.change == "onset"
            and d.stage == "confirmed"]


def test_a_fault_that_begins_inside_the_warm_up_is_found_and_not_learned_as_healthy() -> None:
    for seed in range(5):
        xs, faults = _demo_like(seed)
        onsets = _onsets(detect_series(xs))
        first = faults[0][0]
        assert first < 48  # the fault begins inside the warm-up
        found = [d for d in onsets if faults[0][0] - 3 <= d.index <= faults[0][0] + 8]
        assert found, (seed, onsets)
        # found as the warm-up settles (48 points), against the level before it
        assert found[0].detected_at <= 60
        assert abs(found[0].healthy_s / HEALTHY - 1.0) < 0.03


def test_every_later_fault_of_the_demo_is_found_against_the_true_healthy_level() -> None:
    for seed in range(5):
        xs, faults = _demo_like(seed)
        onsets = _onsets(detect_series(xs))
        for lo, hi in faults[1:]:
            hits = [d for d in onsets if lo - 3 <= d.index < hi]
            assert hits, (seed, lo, hi, onsets)
            assert hits[0].detected_at - lo <= 10
            # Learned from the warm-up's 0.72 s the healthy level sat 19% high and fault 4 went
            # unseen. It is 0.605 s now; the slow follower (`healthy_rate`, from the level of
            # `before` points ago) still lifts it up to ~5.5% in the iterations after a +52%
            # slowdown ends, well short of hiding a 20% one.
            assert abs(hits[0].healthy_s / HEALTHY - 1.0) < 0.06


def test_a_warm_up_that_decays_from_slower_is_still_no_slowdown() -> None:
    for seed in range(5):
        rng = np.random.default_rng(200 + seed)
        n = 300
        t = np.arange(n)
        xs = HEALTHY * np.exp(np.log(2.0) * np.exp(-t / 10.0)) * (1 + 0.02 * rng.standard_normal(n))
        assert not [d for d in detect_series(xs) if d.kind == "slowdown"]
