"""The group-by helpers agree with numpy's own unique/argsort on every path they take.

codes and combine_dense pick a lookup table, a packed sort or a lexsort depending on value
ranges; each path must number groups the same way (sorted order) and keep first occurrences.
"""

import numpy as np
import pytest

from greyhound.core.localize import codes, combine_codes, combine_dense, group_quantile, order_by_code


@pytest.mark.parametrize(
    "values",
    [
        np.array([5, 3, 5, 9, 3, 3], np.int64),  # small range: lookup table
        np.array([7, 1 << 40, 7, -(1 << 30), 1 << 40, 12], np.int64),  # wide range: packed sort
        np.array([2**64 - 1, 0, 2**64 - 1, 17], np.uint64),  # wider than int64: argsort
        np.array([True, False, True]),
        np.array(["tree", "ring", "tree"]),
        np.zeros(0, np.int64),
    ],
)
def test_codes_match_numpy_unique(values):
    uniq, code = codes(values)
    want, inverse = np.unique(values, return_inverse=True)
    assert uniq.dtype == want.dtype
    assert np.array_equal(uniq, want)
    assert np.array_equal(code, inverse.reshape(-1))
    assert code.dtype == np.int64


@pytest.mark.parametrize("high", [3, 5_000, 1 << 40])
def test_combine_codes_number_rows_in_sorted_order_and_keep_first(high):
    rng = np.random.default_rng(high)
    a = rng.integers(0, 4, 3_000)
    b = rng.integers(0, high, 3_000)
    b[::7] = b[0]  # repeated rows even when the range is huge
    code, first = combine_codes(a, b)
    rows = np.stack((a, b), axis=1)
    _, want_first, want_code = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    assert np.array_equal(code, want_code.reshape(-1))
    assert np.array_equal(first, want_first)


def test_combine_codes_where_each_first_value_uses_a_narrow_range_of_the_second():
    # like (communicator, rank): the plain key is wide, the ranks of one communicator are close
    rng = np.random.default_rng(5)
    a = rng.integers(0, 2_000, 20_000)
    b = a * 10_000 + rng.integers(0, 3, 20_000)
    code, first = combine_codes(a, b)
    _, want_first, want_code = np.unique(
        np.stack((a, b), axis=1), axis=0, return_index=True, return_inverse=True
    )
    assert np.array_equal(code, want_code.reshape(-1))
    assert np.array_equal(first, want_first)


def test_combine_dense_falls_back_to_lexsort_when_the_radix_overflows():
    rng = np.random.default_rng(3)
    cols = [rng.integers(0, 3, 500) for _ in range(3)]
    spans = [1 << 30, 1 << 30, 3]  # 2^61 x 3 overflows the packed key
    code, first = combine_dense(cols, spans)
    _, want_first, want_code = np.unique(
        np.stack(cols, axis=1), axis=0, return_index=True, return_inverse=True
    )
    assert np.array_equal(code, want_code.reshape(-1))
    assert np.array_equal(first, want_first)


def test_combine_dense_empty_and_single_row():
    code, first = combine_dense([np.zeros(0, np.int64)], [1])
    assert len(code) == 0 and len(first) == 0
    code, first = combine_dense([np.array([2]), np.array([0])], [3, 1])
    assert code.tolist() == [0] and first.tolist() == [0]


def test_order_by_code_is_stable():
    rng = np.random.default_rng(4)
    code = rng.integers(0, 50, 10_000)
    assert np.array_equal(order_by_code(code, 50), np.argsort(code, kind="stable"))
    assert len(order_by_code(np.zeros(0, np.int64), 0)) == 0


def test_group_quantile_ties_and_single_member_groups():
    group = np.array([0, 0, 0, 0, 1, 2, 2])
    values = np.array([4.0, 1.0, 4.0, 1.0, 7.0, 3.0, 3.0])
    q = group_quantile(group, values, 4, 0.25)
    assert q[0] == np.quantile([4.0, 1.0, 4.0, 1.0], 0.25)
    assert q[1] == 7.0 and q[2] == 3.0 and np.isnan(q[3])


def test_group_quantile_matches_numpy_with_common_and_rare_group_sizes():
    # many groups of 8 and of 5 (sorted as matrix rows), a few of 40 and single members (argsort)
    rng = np.random.default_rng(6)
    sizes = np.concatenate((np.full(300, 8), np.full(40, 5), np.full(3, 40), np.ones(10, np.int64)))
    group = rng.permutation(np.repeat(np.arange(len(sizes)), sizes))
    values = rng.integers(0, 6, len(group)).astype(np.float64)  # many ties
    n_groups = len(sizes) + 2  # two empty groups
    for q in (0.25, 0.5, 0.9):
        got = group_quantile(group, values, n_groups, q)
        want = [np.quantile(values[group == g], q) for g in range(len(sizes))]
        assert np.allclose(got[: len(sizes)], want, rtol=0, atol=1e-12)
        assert np.isnan(got[-2:]).all()
