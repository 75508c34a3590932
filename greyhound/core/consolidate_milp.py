"""S3 (b) where no closed form picks the layout: a mixed-integer program over stage assignments.

Variables: x[g, c] = 1 when straggler g sits in cell c (one stage of one pipeline); each straggler
in one cell, at most TP stragglers per cell. A cell's micro-batch time tau[c] is its stage's
healthy time times the largest factor among its stragglers (tau >= h_s and tau >= h_s f_g x[g, c]).
A pipeline's time is estimated by the classic 1F1B bound sum_s tau[s, d] + (m_d - 1) max_s tau[s, d]
(fill and drain through every stage, then the slowest stage paces the steady state), which is
linear with one auxiliary maximum per pipeline. Minimise the slowest pipeline, plus a tiny cost
per moved straggler so that equal layouts keep GPUs where they are.

The estimate ignores where in the pipeline a slow stage sits (the exact schedule charges a late
stage more), so the caller times the answer on the exact schedule before using it. HiGHS runs
under a time limit; when it stops early, its best layout so far is returned and marked capped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from greyhound.core.arrays import IntArray
from greyhound.core.layout import ParallelShape

if TYPE_CHECKING:
    from greyhound.core.arrays import FloatArray
    from greyhound.core.consolidate import PipelineCosts


@dataclass(frozen=True, slots=True)
class MilpCells:
    cells: IntArray  # per straggler, stage * DP + dp
    capped: bool
    status: str


def _cvxpy() -> Any:
    import cvxpy

    return cvxpy


def assign_cells(
    shape: ParallelShape,
    costs: PipelineCosts,
    factors: FloatArray,
    current: IntArray,
    *,
    time_limit_s: float,
) -> MilpCells | None:
    """The MILP's layout, or None when HiGHS found none within the time limit."""
    cp = _cvxpy()
    k, cells = len(factors), shape.pp * shape.dp
    healthy = np.repeat(costs.forward_s + costs.backward_s, shape.dp)  # per cell, stage-major
    x = cp.Variable((k, cells), boolean=True)
    tau = cp.Variable(cells)
    widest = cp.Variable(shape.dp)
    slowest = cp.Variable()
    stay = np.zeros((k, cells))
    stay[np.arange(k), current] = 1.0
    per_stage = cp.reshape(tau, (shape.pp, shape.dp), order="C")
    m = costs.microbatches.astype(np.float64)
    constraints = [
        cp.sum(x, axis=1) == 1,
        cp.sum(x, axis=0) <= shape.tp,
        tau >= healthy,
        cp.multiply(np.outer(factors, healthy), x) <= cp.reshape(tau, (1, cells), order="C"),
        per_stage <= cp.reshape(widest, (1, shape.dp), order="C"),
        cp.sum(per_stage, axis=0) + cp.multiply(m - 1.0, widest) <= slowest,
    ]
    tiny = 1e-6 * float(np.min(healthy))
    problem = cp.Problem(cp.Minimize(slowest + tiny * (k - cp.sum(cp.multiply(stay, x)))), constraints)
    problem.solve(solver=cp.HIGHS, time_limit=float(time_limit_s))
    if x.value is None:
        return None
    chosen = np.asarray(np.argmax(np.asarray(x.value), axis=1), dtype=np.int64)
    return MilpCells(chosen, capped=problem.status != cp.OPTIMAL, status=str(problem.status))
