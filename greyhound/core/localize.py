"""Comparable clusters of communication groups, and the groups slower than their cluster.

GREYHOUND's profiling step: groups that run the same operation on the same data volume (e.g. the
DP AllReduce groups of equally sized PP stages) should take the same time, so a group more than
10% above its cluster's median is degraded. Ring and tree runs are kept in separate clusters, as
CCL-D does, because NCCL picks the algorithm per call and the two have different costs.

Also home of the group-by helpers the other localisation cores share: every reduction here is a
lookup table or one sort plus index arithmetic, never a Python loop over ranks. At 10^5 rows a
numpy call costs about as much as a pass over the data, so they avoid argsort (several times a
plain sort), np.unique's inverse, and temporaries a table or a bincount makes unnecessary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from greyhound.core.arrays import FloatArray, IntArray

Evidence = dict[str, float | int | str | list[object]]


# A value range up to this many times the element count is coded through a lookup table: a
# table pass is cheaper than a sort until then, and only the table entries in use are touched
# (at most 8 x 16 bytes of table per element when the keys are spread out).
_TABLE_FACTOR = 16
# Group sizes shared by this many groups or more are sorted as rows of one matrix.
_MIN_ROWS_PER_SIZE = 16


def codes(values: ArrayLike) -> tuple[NDArray[Any], IntArray]:
    """Distinct values (sorted) and, per element, the index of its value (a dense int code).

    Integers within a moderate range are coded through a lookup table, others through one sort
    of the values packed with their positions: both avoid np.unique's inverse and np.argsort,
    which dominate at 10^5 rows (a plain sort is several times faster than an argsort).
    """
    a = np.asarray(values).reshape(-1)
    if a.dtype.kind not in "iub" or a.size == 0:
        uniq, inverse = np.unique(a, return_inverse=True)
        return uniq, inverse.astype(np.int64).reshape(-1)
    lo, hi = int(a.min()), int(a.max())
    if hi - lo >= 2**62:  # shifting into int64 could overflow
        order = np.argsort(a, kind="stable").astype(np.int64, copy=False)
        inverse, first = _runs_to_codes(a[order], order)
        return a[first], inverse
    if a.dtype.kind == "b":
        shifted = a.astype(np.int64) - lo
    else:
        shifted = (a - a.dtype.type(lo)).astype(np.int64, copy=False)
    code, distinct = _dense_codes(shifted, hi - lo)
    if lo >= 2**63:  # a uint64 base beyond int64: add in uint64
        return (distinct.astype(np.uint64) + np.uint64(lo)).astype(a.dtype), code
    return (distinct + lo).astype(a.dtype), code


def combine_codes(*columns: IntArray) -> tuple[IntArray, IntArray]:
    """One dense code per distinct row of several int columns, and one row index per code."""
    if len(columns[0]) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    dense = [codes(c)[1] for c in columns]
    return combine_dense(dense, [int(d.max()) + 1 for d in dense])


def combine_dense(columns: Sequence[IntArray], spans: Sequence[int]) -> tuple[IntArray, IntArray]:
    """combine_codes for columns that are already dense codes, column i in [0, spans[i]).

    Codes number the distinct rows in lexicographic order; the row kept per code is its first
    occurrence. Columns are folded in pairwise, each pair through `_pair_key`.
    """
    n = len(columns[0])
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    code, n_codes = columns[0].astype(np.int64, copy=False), spans[0]
    if len(columns) == 1:
        code, distinct = _dense_codes(code, n_codes - 1)
        n_codes = len(distinct)
    for column, span in zip(columns[1:], spans[1:], strict=True):
        code, n_codes = _pair_codes(code, n_codes, column.astype(np.int64, copy=False), span)
    first = np.full(n_codes, n, np.int64)
    np.minimum.at(first, code, np.arange(n))
    return code, first


def _pair_codes(a: IntArray, span_a: int, b: IntArray, span_b: int) -> tuple[IntArray, int]:
    """Dense lexicographic codes of (a, b) pairs, and how many there are.

    The plain key a * span_b + b is often far sparser than the data (every communicator times
    every rank), so when it is too wide for a table each a gets only the range of b it uses.
    """
    if span_a * span_b >= 2**62:
        order = np.lexsort((b, a)).astype(np.int64, copy=False)
        a_sorted, b_sorted = a[order], b[order]
        new = np.ones(len(a), dtype=bool)
        new[1:] = (a_sorted[1:] != a_sorted[:-1]) | (b_sorted[1:] != b_sorted[:-1])
        code = np.empty(len(a), np.int64)
        code[order] = np.cumsum(new) - 1
        return code, int(np.count_nonzero(new))
    max_key = span_a * span_b - 1
    table_limit = _TABLE_FACTOR * len(a) + 4096
    if max_key < table_limit or span_a >= table_limit:  # a table, or else a sort, of the plain key
        code, distinct = _dense_codes(a * span_b + b, max_key)
        return code, len(distinct)
    b_lo = np.full(span_a, span_b, np.int64)
    np.minimum.at(b_lo, a, b)
    b_hi = np.full(span_a, -1, np.int64)
    np.maximum.at(b_hi, a, b)
    width = np.maximum(b_hi - b_lo + 1, 0)
    offset = np.zeros(span_a + 1, np.int64)
    np.cumsum(width, out=offset[1:])
    code, distinct = _dense_codes(offset[a] + (b - b_lo[a]), int(offset[-1]) - 1)
    return code, len(distinct)


def _dense_codes(key: IntArray, max_key: int) -> tuple[IntArray, IntArray]:
    """Codes numbering non-negative int keys (at most max_key) in sorted order, and the keys."""
    n = len(key)
    if max_key < _TABLE_FACTOR * n + 4096:
        present = np.zeros(max_key + 1, dtype=bool)
        present[key] = True
        distinct = np.flatnonzero(present)
        lookup = np.empty(max_key + 1, np.int64)  # untouched entries cost nothing
        lookup[distinct] = np.arange(len(distinct))
        return lookup[key], distinct
    ordered, order = _sort_with_order(key, max_key)
    code, first = _runs_to_codes(ordered, order)
    return code, key[first]


def order_by_code(code: IntArray, n_codes: int) -> IntArray:
    """The stable permutation that sorts dense codes in [0, n_codes): ties keep their order.

    Up to 2^16 codes numpy radix-sorts them as uint16; beyond, the packed sort is used.
    """
    if len(code) == 0:
        return np.zeros(0, np.int64)
    if n_codes <= 1 << 16:
        return np.argsort(code.astype(np.uint16), kind="stable").astype(np.int64, copy=False)
    return _sort_with_order(code.astype(np.int64, copy=False), n_codes - 1)[1]


def _sort_with_order(keys: IntArray, max_key: int) -> tuple[IntArray, IntArray]:
    """Non-negative int64 keys sorted stably, and the permutation that does it.

    Each key is packed above its own position and the packed values sorted: the sort is
    vectorised where an argsort is not, and positions break ties, so the result is stable.
    """
    n = len(keys)
    bits = max(n - 1, 1).bit_length()
    if max_key >= 1 << (63 - bits):
        order = np.argsort(keys, kind="stable").astype(np.int64, copy=False)
        return keys[order], order
    packed = np.sort((keys << bits) | np.arange(n, dtype=np.int64))
    return packed >> bits, packed & ((1 << bits) - 1)


def _runs_to_codes(ordered: NDArray[Any], order: IntArray) -> tuple[IntArray, IntArray]:
    """From sorted values and their permutation: per-element codes, and each code's first row."""
    new = np.ones(len(ordered), dtype=bool)
    new[1:] = ordered[1:] != ordered[:-1]
    code = np.empty(len(ordered), np.int64)
    code[order] = np.cumsum(new, dtype=np.int64) - 1
    return code, order[new]


def order_within_groups(group: IntArray, values: FloatArray, n_groups: int) -> IntArray:
    """Indices sorting by group, then by value: one float argsort instead of a lexsort.

    Group g's values are shifted into [g * span, g * span + range]; float64 keeps their order to
    about n_groups x 2^-52 of their range, so beyond ~4 million groups the lexsort is used.
    """
    if len(group) == 0:
        return np.zeros(0, np.int64)
    lo, hi = float(values.min()), float(values.max())
    width = hi - lo
    if n_groups >= 4_000_000 or not np.isfinite(width):
        return np.lexsort((values, group)).astype(np.int64, copy=False)
    span = width * (1.0 + 1e-6) + (1.0 if width == 0.0 else 0.0)
    return np.argsort(group * span + (values - lo)).astype(np.int64, copy=False)


def group_median(group: IntArray, values: FloatArray, n_groups: int) -> FloatArray:
    """Median of `values` per dense group code (NaN for an empty group)."""
    return group_quantile(group, values, n_groups, 0.5)


def group_quantile(group: IntArray, values: FloatArray, n_groups: int, q: float) -> FloatArray:
    """Quantile q of `values` per dense group code, interpolated between order statistics."""
    out = np.full(n_groups, np.nan)
    if len(group) == 0:
        return out
    counts = np.bincount(group, minlength=n_groups)
    v = _sorted_within_groups(group, values, counts)
    starts = np.zeros(n_groups, np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    has = counts > 0
    pos = (counts[has] - 1) * q
    lo = np.floor(pos).astype(np.int64)
    frac = pos - lo
    hi = np.minimum(lo + 1, counts[has] - 1)
    out[has] = v[starts[has] + lo] * (1.0 - frac) + v[starts[has] + hi] * frac
    return out


def _sorted_within_groups(group: IntArray, values: FloatArray, counts: IntArray) -> FloatArray:
    """`values` ordered by group, each group's values ascending (exactly, not by a float key).

    Groups usually come in a few sizes (every instance of a communicator has its members), so
    the groups of one common size are sorted as the rows of one matrix, the others by one float
    argsort; with no common size (or very many) the argsort does it all.
    """
    n_groups = len(counts)
    n_per_size = np.bincount(counts)
    bulk = np.flatnonzero(n_per_size >= _MIN_ROWS_PER_SIZE)
    bulk = bulk[bulk > 1]
    if len(bulk) == 0 or len(bulk) > 8:
        return values[order_within_groups(group, values, n_groups)]
    v = values[order_by_code(group, n_groups)]
    row_size = np.repeat(counts, counts)
    for size in bulk.tolist():
        rows = np.flatnonzero(row_size == size)
        block = v[rows].reshape(-1, size)
        block.sort(axis=1)
        v[rows] = block.reshape(-1)
    rest = np.flatnonzero((row_size > 1) & (n_per_size[row_size] < _MIN_ROWS_PER_SIZE))
    if len(rest):
        rest_group = np.repeat(np.arange(n_groups), counts)[rest]
        v[rest] = v[rest][order_within_groups(rest_group, v[rest], n_groups)]
    return v


@dataclass(frozen=True, slots=True, eq=False)
class GroupTimings:
    """Profiled collective calls, one element per call (per group, not per rank).

    `group_id` is the communicator, `op` the operation (name or code), `nbytes` the data volume,
    `algo` the algorithm NCCL used ("ring"/"tree" or a code) and `duration_ns` the execution time
    measured with CUDA events around the call.
    """

    group_id: IntArray
    op: NDArray[Any]
    nbytes: IntArray
    algo: NDArray[Any]
    duration_ns: FloatArray

    def __post_init__(self) -> None:
        object.__setattr__(self, "group_id", np.asarray(self.group_id, dtype=np.int64))
        object.__setattr__(self, "op", np.asarray(self.op))
        object.__setattr__(self, "nbytes", np.asarray(self.nbytes, dtype=np.int64))
        object.__setattr__(self, "algo", np.asarray(self.algo))
        object.__setattr__(self, "duration_ns", np.asarray(self.duration_ns, dtype=np.float64))
        n = len(self.group_id)
        if any(len(a) != n for a in (self.op, self.nbytes, self.algo, self.duration_ns)):
            raise ValueError("GroupTimings arrays must have equal lengths")


@dataclass(frozen=True, slots=True)
class SlowGroup:
    group_id: int
    op: str
    nbytes: int
    algo: str
    time_ns: float
    cluster_median_ns: float
    ratio: float
    evidence: Evidence = field(default_factory=dict)


def find_slow_groups(groups: GroupTimings, *, threshold: float = 0.10) -> list[SlowGroup]:
    """Groups whose median call time is more than `threshold` above their cluster's median.

    A cluster is one (op, nbytes, algo); a group appears in as many clusters as it has distinct
    calls, and is reported once, for the cluster where it stands out most. A cluster of one group
    has nothing to compare with and flags nothing.
    """
    if len(groups.group_id) == 0:
        return []
    op_values, op_code = codes(groups.op)
    algo_values, algo_code = codes(groups.algo)
    gid_values, gid_code = codes(groups.group_id)
    cluster, cluster_first = combine_codes(op_code, groups.nbytes, algo_code)
    cell, cell_first = combine_codes(cluster, gid_code)
    cell_time = group_median(cell, groups.duration_ns, len(cell_first))
    cell_cluster = cluster[cell_first]
    n_clusters = len(cluster_first)
    cluster_median = group_median(cell_cluster, cell_time, n_clusters)
    cluster_groups = np.bincount(cell_cluster, minlength=n_clusters)
    ratio = cell_time / cluster_median[cell_cluster]
    slow = (ratio > 1.0 + threshold) & (cluster_groups[cell_cluster] > 1)
    if not np.any(slow):
        return []
    slow_cells = np.flatnonzero(slow)
    cell_gid = gid_code[cell_first]
    flagged_per_group = np.bincount(cell_gid[slow_cells], minlength=len(gid_values))
    clusters_per_group = np.bincount(cell_gid, minlength=len(gid_values))
    # the worst cluster per group: sort slow cells by (group, -ratio) and keep the first of each
    order = np.lexsort((-ratio[slow_cells], cell_gid[slow_cells]))
    slow_cells = slow_cells[order]
    first = np.ones(len(slow_cells), dtype=bool)
    first[1:] = cell_gid[slow_cells][1:] != cell_gid[slow_cells][:-1]
    result: list[SlowGroup] = []
    for c in slow_cells[first]:
        row = cell_first[c]
        k = cell_cluster[c]
        g = cell_gid[c]
        evidence: Evidence = {
            "op": str(op_values[op_code[row]]),
            "nbytes": int(groups.nbytes[row]),
            "algo": str(algo_values[algo_code[row]]),
            "group_time_ns": float(cell_time[c]),
            "cluster_median_ns": float(cluster_median[k]),
            "ratio": float(ratio[c]),
            "threshold": threshold,
            "cluster_groups": int(cluster_groups[k]),
            "clusters_flagged": int(flagged_per_group[g]),
            "clusters_total": int(clusters_per_group[g]),
        }
        result.append(
            SlowGroup(
                group_id=int(gid_values[g]),
                op=str(evidence["op"]),
                nbytes=int(groups.nbytes[row]),
                algo=str(evidence["algo"]),
                time_ns=float(cell_time[c]),
                cluster_median_ns=float(cluster_median[k]),
                ratio=float(ratio[c]),
                evidence=evidence,
            )
        )
    result.sort(key=lambda s: -s.ratio)
    return result
