"""PyTorch side of S2: uneven micro-batch counts per DP rank with the uniform split's gradients.

Use, in a training loop over a DP group of ``dp_size`` ranks with M micro-batches per iteration::

    follower = TorchPlanFollower(dp_rank=dp_rank, dp_size=dp_size, microbatches=M,
                                 source=fetch_plan, on_applied=report, group=dp_group)
    for step in ...:
        follower.next_iteration()                   # fetches, agrees, adopts the plan
        for j in follower.microbatch_slice():       # this rank's micro-batches of the global batch
            loss = loss_fn(model(x[j]), y[j]) * follower.loss_scale   # 1 / M
            loss.backward()
        follower.allreduce_gradients(model)         # SUM over the DP group
        optimizer.step(); optimizer.zero_grad()

``fetch_plan`` is any callable returning a :class:`MicrobatchPlan` or a mapping (``{"version": 3,
"counts": [...]}``) or None; ``PlanClient.fetch`` (greyhound.integrations.rest) reads the
planner's ``GET /v1/jobs/{id}/plan`` with a job token, and ``PlanClient.on_applied`` reports each
adopted version with its cost (docs/mitigation.md). Rank 0 of ``group`` fetches and
broadcasts the plan (``version`` and counts as one int64 tensor on ``device``), so all ranks switch
at the same iteration even when a fetch races a plan update; plans that do not fit the job are
ignored and reported to ``on_error``, never raised into the loop. With torch's
``DistributedDataParallel`` instead of :meth:`allreduce_gradients`, which averages over ranks,
scale each loss by ``dp_size / M`` (``ddp_loss_scale``) and wrap all but the rank's last micro-batch
in ``model.no_sync()``: every rank then reduces once per iteration whatever its count.

Megatron-LM (optional, not imported): the hook point is the micro-batch calculator,
``megatron.core.num_microbatches_calculator``. Its global calculator's ``get()``, read through
``get_num_microbatches()`` by the training step before calling the pipeline schedule, returns
``follower.next_iteration()``'s count for the rank's DP group (every TP and PP rank of DP group i
runs m_i; with 1F1B, m_i a multiple of PP where the schedule needs it, which the planner's
``multiple_of`` gives). The schedule divides each micro-batch loss by that count and the DDP
wrapper scales gradients by ``gradient_scaling_factor`` (1 / dp_size with
``average_in_collective=False``) before a SUM reduction: set every bucket's
``gradient_scaling_factor`` to ``follower.gradient_weight`` (m_i / M) so the reduction again
yields the uniform split's gradient. The data sampler takes the rank's
``microbatch_slice()`` of the global batch instead of its fixed 1 / dp_size share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from greyhound.integrations.plan_follower import (
    AppliedPlan,
    MicrobatchPlan,
    PlanFollower,
    PlanSource,
)

__all__ = ["AppliedPlan", "MicrobatchPlan", "PlanSource", "TorchPlanFollower"]


class TorchPlanFollower(PlanFollower):
    """:class:`PlanFollower` whose ranks agree over ``torch.distributed`` and reduce gradients."""

    def __init__(
        self,
        *,
        dp_rank: int,
        dp_size: int,
        microbatches: int,
        source: PlanSource | MicrobatchPlan | None = None,
        on_applied: Callable[[AppliedPlan], None] | None = None,
        on_error: Callable[[Exception], None] | None = None,
        group: Any = None,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(dp_rank=dp_rank, dp_size=dp_size, microbatches=microbatches, source=source,
                         on_applied=on_applied, on_error=on_error)
        self.group = group
        self.device = torch.device(device)

    @property
    def ddp_loss_scale(self) -> float:
        """Per-micro-batch loss scale under torch DDP, which divides the summed gradient by dp_size."""
        return self.dp_size / self.total

    def fetch(self) -> MicrobatchPlan | None:
        # Only the group's first rank asks the source; the others take its answer in agree().
        if self._distributed() and self.dp_rank != 0:
            return None
        return super().fetch()

    def agree(self, plan: MicrobatchPlan | None) -> MicrobatchPlan | None:
        if not self._distributed():
            return plan
        msg = torch.full((self.dp_size + 2,), -1, dtype=torch.int64, device=self.device)
        if plan is not None:
            msg[0], msg[1] = 1, plan.version
            msg[2:] = torch.tensor(plan.counts, dtype=torch.int64)
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast(msg, src=src, group=self.group)
        values = [int(v) for v in msg.tolist()]
        if values[0] != 1:
            return None
        return MicrobatchPlan(values[1], tuple(values[2:]))

    def allreduce_gradients(self, module: torch.nn.Module) -> None:
        """SUM every parameter's gradient over the DP group (losses were scaled by 1 / M)."""
        if not self._distributed():
            return
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        if not grads:
            return
        # One collective for the whole model rather than one per parameter.
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def _distributed(self) -> bool:
        return self.dp_size > 1 and dist.is_available() and dist.is_initialized()
