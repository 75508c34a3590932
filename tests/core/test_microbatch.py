"""S2's allocator against every allocation (small cases) and against cvxpy's MILP (larger ones)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest

from greyhound.core.microbatch import allocate_microbatches
from greyhound.core.microbatch_milp import allocate_microbatches_milp


def compositions(total: int, parts: int, step: int) -> Iterator[tuple[int, ...]]:
    """Every way to write ``total`` as ``parts`` positive multiples of ``step``."""
    units = total // step
    for cuts in itertools.combinations(range(1, units), parts - 1):
        bounds = (0, *cuts, units)
        yield tuple(step * (b - a) for a, b in itertools.pairwise(bounds))


def brute_force(times: list[float], total: int, step: int) -> tuple[float, tuple[int, ...]]:
    """The optimal makespan and the allocation the tie rule names, by enumeration.

    Tie rule: finishing times sorted from the largest down, lexicographically smallest; then the
    counts themselves, lexicographically largest.
    """
    def key(c: tuple[int, ...]) -> tuple[tuple[float, ...], tuple[int, ...]]:
        loads = sorted((m * t for m, t in zip(c, times, strict=True)), reverse=True)
        return tuple(loads), tuple(-m for m in c)

    best = min(compositions(total, len(times), step), key=key)
    return max(m * t for m, t in zip(best, times, strict=True)), best


# Times are multiples of 1/8, so every product is exact in binary floating point and the
# brute force's ties are real ties.
def dyadic_cases() -> list[tuple[list[float], int, int]]:
    rng = np.random.default_rng(7)
    cases: list[tuple[list[float], int, int]] = [
        ([1.0, 1.0, 1.0, 1.0], 6, 1),
        ([1.85, 1.0, 1.0, 1.0], 64, 2),
        ([10.0, 1.0, 1.0, 1.0], 20, 1),
        ([1.5, 1.0, 1.0], 4, 1),
        ([2.0, 3.0], 5, 1),
        ([1.0], 7, 1),
        ([4.0, 4.0, 1.0], 12, 3),
    ]
    for _ in range(120):
        d = int(rng.integers(1, 6))
        step = int(rng.choice([1, 1, 2, 3]))
        total = step * int(rng.integers(d, d + 9))
        times = [float(x) / 8 for x in rng.integers(4, 24, d)]
        cases.append((times, total, step))
    return cases


@pytest.mark.parametrize(("times", "total", "step"), dyadic_cases())
def test_equals_brute_force_makespan_and_tie_rule(times: list[float], total: int, step: int) -> None:
    got = allocate_microbatches(times, total, multiple_of=step)
    makespan, counts = brute_force(times, total, step)
    assert got.makespan == makespan
    assert got.counts == counts
    assert sum(got.counts) == total
    assert all(c >= step and c % step == 0 for c in got.counts)


def test_paper_s2_case_and_even_split_shape() -> None:
    assert allocate_microbatches([1.85, 1, 1, 1], 64, multiple_of=2).counts == (10, 18, 18, 18)
    # Equal groups: Megatron's even split with the remainder on the first groups.
    assert allocate_microbatches([0.3] * 4, 6).counts == (2, 2, 1, 1)
    # A group too slow for more than one micro-batch still keeps one; the rest balance the others.
    assert allocate_microbatches([10, 1, 1, 1], 20).counts == (1, 7, 6, 6)


@pytest.mark.parametrize("d", [8, 24, 48])
def test_equals_cvxpy_makespan_on_random_profiles(d: int) -> None:
    rng = np.random.default_rng(d)
    for step, total in ((1, 5 * d + 3), (2, 8 * d)):
        times = rng.uniform(0.8, 2.5, d)
        times[rng.integers(d)] *= 1.8
        ours = allocate_microbatches(times, total, multiple_of=step)
        milp = allocate_microbatches_milp(times, total, multiple_of=step, time_limit_s=60)
        assert not milp.capped, milp.status
        assert ours.makespan == pytest.approx(milp.makespan, rel=1e-9)
        assert sum(ours.counts) == total


def test_large_inputs_keep_their_invariants() -> None:
    """At scale (no brute force), the answer is optimal by its own certificate: giving any group
    one unit less would force some group past the makespan."""
    rng = np.random.default_rng(3)
    d, step = 4096, 2
    times = rng.uniform(1.0, 3.0, d)
    total = 2 * 10 * d + 6
    got = allocate_microbatches(times, total, multiple_of=step)
    m = np.array(got.counts)
    assert m.sum() == total and (m >= step).all() and (m % step == 0).all()
    assert got.makespan == float(np.max(m * times))
    # Certificate: at any makespan below ours, the groups hold fewer than ``total`` micro-batches.
    below = np.nextafter(got.makespan, 0.0)
    capacity = np.floor(below / (step * times)).astype(np.int64) * step
    assert (capacity < step).any() or capacity.sum() < total


@pytest.mark.parametrize(
    ("times", "total", "step", "message"),
    [
        ([], 4, 1, "empty"),
        ([1.0, 0.0], 4, 1, r"times\[1\]"),
        ([1.0, -2.0], 4, 1, "positive"),
        ([1.0, float("nan")], 4, 1, "finite"),
        ([1.0, 1.0, 1.0], 2, 1, "microbatches 2 < 3"),
        ([1.0, 1.0], 6, 4, "microbatches 6 < 8"),
        ([1.0, 1.0], 9, 2, "not a multiple of 2"),
        ([1.0], 3, 0, "multiple_of must be >= 1"),
        ([[1.0, 2.0]], 4, 1, "1-D"),
    ],
)
def test_bad_input_is_a_clear_value_error(times: list[float], total: int, step: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        allocate_microbatches(times, total, multiple_of=step)


def test_extreme_ratios_and_huge_totals_stay_exact() -> None:
    got = allocate_microbatches([1e-6, 1e6], 10**12)
    assert got.counts == (10**12 - 1, 1)
    assert got.makespan == 1e6
    got = allocate_microbatches([0.5, 0.25, 0.125], 7 * 10**9)
    assert got.counts == (10**9, 2 * 10**9, 4 * 10**9)
