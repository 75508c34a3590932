"""S2: spread a global batch's micro-batches over DP groups so that the slowest group finishes first.

Group i runs m_i micro-batches of t_i seconds each (profiled), so it finishes after m_i * t_i; the
iteration waits for the slowest. We minimise max_i m_i t_i subject to sum_i m_i = M, every
m_i >= 1 (a group with no micro-batch would leave the 1F1B schedule and the gradient all-reduce
with nothing to do) and, where the pipeline schedule needs it, m_i a multiple of P.

Why not the paper's integer program: the structure makes it a selection problem. Writing
m_i = P q_i, group i's possible finishing times are the "slots" t_i, 2 t_i, 3 t_i, ...; every
group takes its first slot, and the remaining Q - D (Q = M / P) go, one at a time, to the group
whose finishing time after taking it is smallest. That greedy is exact for min-max (each slot it
takes is the cheapest one left, so no allocation can finish all Q slots earlier), and its
answer is the (Q - D)-th smallest of the later slots. We find that slot without the greedy's
Q - D steps: any threshold T admits sum_i max(1, floor(T / t_i)) slots, which lies within D of
T * sum_i 1/t_i, so the answer lies in a window that holds only about 3 D slots; we enumerate
those and select with ``numpy.partition``: O(D) memory, O(D) time, independent of M.

Tie rule (the allocation among the optimal ones, deterministic): a slot whose finishing time
equals another's goes to the faster group (smaller t_i), then to the lower index. Among all
allocations of optimal makespan this yields the lexicographically smallest vector of finishing
times sorted from the largest down (the slowest groups carry as little as they can, the
remainder of an even split goes to the first groups as in Megatron's default), and for equal
times the lexicographically largest m.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from greyhound.core.arrays import FloatArray, IntArray


@dataclass(frozen=True, slots=True)
class MicrobatchAllocation:
    """Micro-batches per DP group and the slowest group's time with them (``max m_i t_i``)."""

    counts: tuple[int, ...]
    makespan: float

    def as_dict(self) -> dict[str, object]:
        return {"allocation": list(self.counts), "makespan": self.makespan}


def check_inputs(times: Sequence[float] | FloatArray, total: int, multiple_of: int = 1) -> FloatArray:
    """The per-micro-batch times as a float array, or a ValueError that says what is wrong."""
    if isinstance(total, bool) or not isinstance(total, int | np.integer):
        raise ValueError(f"microbatches must be an integer, got {total!r}")
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int | np.integer):
        raise ValueError(f"multiple_of must be an integer, got {multiple_of!r}")
    t = np.asarray(times, dtype=np.float64)
    if t.ndim != 1:
        raise ValueError(f"times must be one value per DP group (1-D), got shape {t.shape}")
    if t.size == 0:
        raise ValueError("times is empty: at least one DP group is needed")
    if not np.all(np.isfinite(t)) or np.any(t <= 0):
        bad = int(np.flatnonzero(~(np.isfinite(t) & (t > 0)))[0])
        raise ValueError(f"times[{bad}] = {t[bad]!r}: every time per micro-batch must be positive and finite")
    if multiple_of < 1:
        raise ValueError(f"multiple_of must be >= 1, got {multiple_of}")
    d = t.size
    if total < d * multiple_of:
        need = f"{d} DP groups" + (f" x multiple {multiple_of}" if multiple_of > 1 else "")
        raise ValueError(f"microbatches {total} < {d * multiple_of}: every one of {need} needs at least "
                         f"{multiple_of} micro-batch{'es' if multiple_of > 1 else ''}")
    if total % multiple_of:
        raise ValueError(f"microbatches {total} is not a multiple of {multiple_of}, so no allocation "
                         f"of multiples of {multiple_of} reaches it")
    return t


def allocate_microbatches(
    times: Sequence[float] | FloatArray, total: int, *, multiple_of: int = 1
) -> MicrobatchAllocation:
    """The exact min-max allocation of ``total`` micro-batches (see the module docstring)."""
    t = check_inputs(times, total, multiple_of)
    q = _allocate_units(t, int(total) // int(multiple_of))
    m = q * int(multiple_of)
    return MicrobatchAllocation(tuple(int(x) for x in m), float(np.max(m * t)))


def _slots_upto(t: FloatArray, threshold: float) -> IntArray:
    """How many slots k * t_i are <= threshold, counted with the same products the slots use.

    ``floor(T / t)`` alone can be off by one where T is itself a product k * t; comparing the
    neighbouring products settles it, so the count and the enumerated slots always agree.
    """
    with np.errstate(over="ignore"):
        k = np.floor(threshold / t)
    k = np.minimum(k, 2.0**62).astype(np.int64)
    k += ((k + 1) * t <= threshold).astype(np.int64)
    k -= (k * t > threshold).astype(np.int64)
    return k


def _allocate_units(t: FloatArray, q_total: int) -> IntArray:
    d = t.size
    if q_total == d:
        return np.ones(d, dtype=np.int64)
    rate = float(np.sum(1.0 / t))
    lo = max(0.0, (q_total - d) / rate) * (1.0 - 1e-9)
    base = np.maximum(1, _slots_upto(t, lo))
    while int(base.sum()) > q_total:  # only float rounding at ``lo``'s edge gets here
        lo *= 0.5
        base = np.maximum(1, _slots_upto(t, lo))
    need = q_total - int(base.sum())
    if need == 0:
        return base
    hi = (q_total + d) / rate * (1.0 + 1e-9)
    top = np.maximum(base, _slots_upto(t, hi) + 1)
    per = top - base
    group = np.repeat(np.arange(d), per)
    starts = np.cumsum(per) - per
    k = base[group] + 1 + (np.arange(group.size) - starts[group])
    value = k * t[group]
    assert value.size >= need, "slot window too small"
    cut = float(np.partition(value, need - 1)[need - 1])
    below = value < cut
    counts = base + np.bincount(group[below], minlength=d)
    rest = need - int(below.sum())
    tied = group[value == cut]  # distinct groups: one group never has two slots of one value
    tied = tied[np.lexsort((tied, t[tied]))][:rest]
    counts[tied] += 1
    return counts
