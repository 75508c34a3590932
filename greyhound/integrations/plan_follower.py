"""The framework-free half of applying an S2 plan inside a training loop.

Between iterations each DP rank asks for the current plan (a callable the user supplies: the REST
client's ``fetch`` (greyhound.integrations.rest), a plan object or a test double), checks it
against the job (one count per DP group, each >= 1, summing to the global batch's M
micro-batches) and adopts it from the next iteration. A plan that fails the checks, or a fetch
that raises, never reaches the training job: the rank keeps the plan it had and reports the
problem to ``on_error`` (a warning in the log by default). Adoption is reported to
``on_applied`` with the time it took, which is the observed cost the escalation policy learns
from.

Gradients stay those of the uniform split: rank i runs the micro-batches
``offset_i .. offset_i + m_i - 1`` of the global batch (offset_i = m_0 + ... + m_{i-1}, so the M
micro-batches are the same whatever the split), scales each micro-batch's loss by 1 / M
(``loss_scale``) and the gradients are summed across ranks: sum_i sum_{j in i} grad(l_j) / M is the
gradient of the global batch's mean loss for every allocation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from greyhound.core.plans import even_split

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MicrobatchPlan:
    """An S2 plan as a training job receives it: micro-batches per DP group, and its version
    (plans are only adopted when the version changes). Empty counts mean the job's own even
    split (the planner reverted its plan)."""

    version: int
    counts: tuple[int, ...]

    @classmethod
    def parse(cls, data: MicrobatchPlan | Mapping[str, Any]) -> MicrobatchPlan:
        """A plan object, or a mapping with ``version`` and ``counts`` (or ``allocation``, as
        ``greyhound plan microbatch`` prints it, or ``microbatches``, as the REST API returns
        it, null there meaning the even split)."""
        if isinstance(data, MicrobatchPlan):
            return data
        if "microbatches" in data and data["microbatches"] is None:
            data = {**data, "microbatches": []}
        counts = data.get("counts", data.get("allocation", data.get("microbatches")))
        if not isinstance(counts, Sequence) or isinstance(counts, str | bytes):
            raise ValueError(f"plan: counts must be a list of integers, got {counts!r}")
        version = data.get("version", 0)
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"plan: version must be an integer, got {version!r}")
        return cls(version, tuple(counts))


@dataclass(frozen=True, slots=True)
class AppliedPlan:
    version: int
    counts: tuple[int, ...]
    dp_rank: int
    iteration: int  # the first iteration that runs with it
    cost_s: float  # fetch, agreement and checks, as measured on this rank


PlanSource = Callable[[], MicrobatchPlan | Mapping[str, Any] | None]


class PlanFollower:
    """One DP rank's view of the S2 plan; call :meth:`next_iteration` before every iteration."""

    def __init__(
        self,
        *,
        dp_rank: int,
        dp_size: int,
        microbatches: int,
        source: PlanSource | MicrobatchPlan | None = None,
        on_applied: Callable[[AppliedPlan], None] | None = None,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        if not (0 <= dp_rank < dp_size):
            raise ValueError(f"dp_rank {dp_rank} out of range [0, {dp_size})")
        if microbatches < dp_size:
            raise ValueError(f"microbatches {microbatches} < dp_size {dp_size}: a rank would have none")
        self.dp_rank, self.dp_size, self.total = dp_rank, dp_size, microbatches
        self._source = source
        self._on_applied = on_applied
        self._on_error = on_error or (lambda e: log.warning("greyhound plan ignored: %s", e))
        self.counts = even_split(microbatches, dp_size)
        self.version: int | None = None
        self.iteration = 0

    @property
    def microbatches(self) -> int:
        """m_i: how many micro-batches this rank runs in the current iteration."""
        return self.counts[self.dp_rank]

    @property
    def loss_scale(self) -> float:
        """Multiply each micro-batch's loss by this, then sum gradients across the DP group."""
        return 1.0 / self.total

    @property
    def gradient_weight(self) -> float:
        """m_i / M: the weight of this rank's gradient when the loop averages its own micro-batches
        (as Megatron's schedule does) before the DP reduction sums them."""
        return self.microbatches / self.total

    def microbatch_slice(self) -> range:
        """Indices, within the global batch's M micro-batches, that this rank runs."""
        start = sum(self.counts[: self.dp_rank])
        return range(start, start + self.microbatches)

    def fetch(self) -> MicrobatchPlan | None:
        """The source's plan, parsed and checked; None when there is none or it is unusable."""
        if self._source is None:
            return None
        try:
            raw = self._source if isinstance(self._source, MicrobatchPlan) else self._source()
            return None if raw is None else self.check(MicrobatchPlan.parse(raw))
        except Exception as exc:  # a broken plan source must never stop training
            self._on_error(exc)
            return None

    def check(self, plan: MicrobatchPlan) -> MicrobatchPlan:
        if not plan.counts:
            return MicrobatchPlan(plan.version, even_split(self.total, self.dp_size))
        c = plan.counts
        if len(c) != self.dp_size:
            raise ValueError(f"plan v{plan.version}: {len(c)} counts for {self.dp_size} DP groups")
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in c):
            raise ValueError(f"plan v{plan.version}: every count must be an integer >= 1, got {list(c)}")
        if sum(c) != self.total:
            raise ValueError(f"plan v{plan.version}: counts sum to {sum(c)}, the job runs {self.total}")
        return plan

    def next_iteration(self) -> int:
        """Fetch, adopt a new plan version if there is one, and return this rank's m_i."""
        start = time.perf_counter()
        plan = self.agree(self.fetch())
        if plan is not None and plan.version != self.version:
            self.counts, self.version = plan.counts, plan.version
            if self._on_applied is not None:
                applied = AppliedPlan(plan.version, plan.counts, self.dp_rank, self.iteration,
                                      time.perf_counter() - start)
                try:
                    self._on_applied(applied)
                except Exception as exc:  # a failing report must not stop training either
                    self._on_error(exc)
        self.iteration += 1
        return self.microbatches

    def agree(self, plan: MicrobatchPlan | None) -> MicrobatchPlan | None:
        """Make every DP rank adopt the same plan at the same iteration; alone, nothing to do.
        Framework adapters override this with a broadcast from one rank."""
        return plan
