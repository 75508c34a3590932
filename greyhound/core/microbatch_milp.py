"""S2 as the paper solves it, with cvxpy: the cross-check of :mod:`greyhound.core.microbatch`.

GREYHOUND poses S2 as an integer program handed to cvxpy. The licence-free MILP solver cvxpy
ships with (HiGHS, through ``highspy``) takes linear objectives, so this is the min-max form
``min T s.t. m_i t_i <= T, sum m_i = M, m_i = P q_i, q_i >= 1 integer``, the objective the
exact solver optimises; the paper's squared-deviation objective would need a mixed-integer
quadratic solver, none of which comes with cvxpy without a licence. It is kept for tests and the
benchmark (``bench/microbatch_solver.py``), never on a planning path: its time grows steeply with D.
cvxpy is imported only when called.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from greyhound.core.arrays import FloatArray
from greyhound.core.microbatch import check_inputs


@dataclass(frozen=True, slots=True)
class MilpResult:
    """The solver's allocation; ``capped`` when the time limit stopped it before it proved optimality
    (the allocation is then the best it had found, possibly not optimal)."""

    counts: tuple[int, ...]
    makespan: float
    seconds: float
    capped: bool
    status: str


def _cvxpy() -> Any:
    """cvxpy, untyped: its partial annotations do not cover the expression API used here."""
    import cvxpy

    return cvxpy


def allocate_microbatches_milp(
    times: Sequence[float] | FloatArray,
    total: int,
    *,
    multiple_of: int = 1,
    time_limit_s: float = 60.0,
) -> MilpResult:
    cp = _cvxpy()
    t = check_inputs(times, total, multiple_of)
    p = int(multiple_of)
    start = time.perf_counter()
    q = cp.Variable(t.size, integer=True)
    makespan = cp.Variable()
    m = p * q
    problem = cp.Problem(
        cp.Minimize(makespan),
        [q >= 1, cp.sum(q) == int(total) // p, cp.multiply(t, m) <= makespan],
    )
    # HiGHS stops at a 1e-4 relative gap by default, which at D >= 256 leaves a makespan ~1e-4 above
    # the optimum; the cross-check must prove optimality, so the gap is zero.
    problem.solve(solver=cp.HIGHS, time_limit=float(time_limit_s), mip_rel_gap=0.0, mip_abs_gap=0.0)
    seconds = time.perf_counter() - start
    if q.value is None:
        raise RuntimeError(f"cvxpy/HiGHS found no allocation (status {problem.status})")
    counts = np.rint(np.asarray(q.value)).astype(np.int64) * p
    return MilpResult(
        counts=tuple(int(c) for c in counts),
        makespan=float(np.max(counts * t)),
        seconds=seconds,
        capped=problem.status != cp.OPTIMAL,
        status=str(problem.status),
    )
