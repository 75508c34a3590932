"""One process of the megatron-core check in test_megatron.py (``python -m
tests.integrations.megatron_worker``), 4 gloo processes on CPU.

S2: Megatron's micro-batch calculator answers the follower's uneven counts, Megatron's own
``forward_step`` / ``backward_step`` run each micro-batch (dividing its loss by the count) and
Megatron's DDP scales and sums the gradients: with the follower's gradient weight the result is
the full batch's gradient, with Megatron's default 1 / dp it is not.

What needs a GPU, and how far this goes without one: Megatron's DDP allocates its gradient
buffers on ``torch.cuda.current_device()`` (param_and_grad_buffer.py), which a CPU build of
torch cannot answer; the test points that one function at the CPU and nothing else. Megatron's
schedule functions (``forward_backward_no_pipelining``, ``forward_backward_pipelining_without_
interleaving``) create a token counter with ``device="cuda"`` before their loop, so they cannot
run on CPU at all: the test runs their loop body (``forward_step``, ``backward_step``, the DDP
``no_sync`` for all but the last micro-batch) itself.

S3: parallel_state initialised by Megatron for PP 2 x DP 2, then rebuilt live by a
``TorchLayoutFollower`` with ``parallel_state_builder`` for a role swap (processes 1 and 2
exchange ranks): Megatron's getters, its DP and PP groups (a SUM and a send / recv through
them), its embedding ranks all follow the new layout; the old groups are destroyed; a rebuild
that fails on one process leaves parallel_state as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import torch
import torch.distributed as dist

from greyhound.core.layout import ParallelShape
from greyhound.integrations.plan_follower import MicrobatchPlan
from greyhound.integrations.topology import Role
from greyhound.integrations.torch import TorchPlanFollower
from greyhound.integrations.torch_layout import TorchLayoutFollower
from greyhound.integrations.torch_state import StageState
from tests.integrations.gloo import worker_args

M, MBS, H = 16, 2, 6


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(M, MBS, H, generator=g), torch.randn(M, MBS, 1, generator=g)


class _Net(torch.nn.Sequential):
    """A model as Megatron's schedule handles one: a model type and ``set_input_tensor``."""

    def __init__(self) -> None:
        from megatron.core.enums import ModelType

        torch.manual_seed(3)
        super().__init__(torch.nn.Linear(H, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        self.model_type = ModelType.encoder_or_decoder

    def set_input_tensor(self, tensor: Any) -> None:
        """One stage only: the input always comes from the data."""


def _net() -> torch.nn.Module:
    return _Net()


def s2(rank: int, counts: tuple[int, ...], weighted: bool) -> list[float]:
    """One iteration of Megatron DDP training under ``counts``; the reduced gradient."""
    from megatron.core import num_microbatches_calculator as nmc
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.pipeline_parallel.schedules import backward_step, forward_step
    from megatron.core.transformer import TransformerConfig

    from greyhound.integrations.megatron import follow_microbatches, set_gradient_weight

    nmc.destroy_num_microbatches_calculator()
    nmc.init_num_microbatches_calculator(rank, None, M * MBS, MBS, ps.get_data_parallel_world_size())
    follower = TorchPlanFollower(dp_rank=ps.get_data_parallel_rank(),
                                 dp_size=ps.get_data_parallel_world_size(), microbatches=M,
                                 source=MicrobatchPlan(1, counts),
                                 group=ps.get_data_parallel_group())
    follow_microbatches(follower)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                               use_cpu_initialization=True)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), _net())
    follower.next_iteration()
    if weighted:
        set_gradient_weight(ddp, follower.gradient_weight)
    n = nmc.get_num_microbatches()
    assert n == counts[ps.get_data_parallel_rank()], (n, counts)
    x, y = _batch()
    mine = iter([(x[j], y[j]) for j in follower.microbatch_slice()])

    def step(it: Any, model: Any) -> tuple[torch.Tensor, Any]:
        xb, yb = next(it)
        out = model(xb)

        def loss(o: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            value = torch.nn.functional.mse_loss(o, yb)
            return value, {"loss": value.detach()}

        return out, loss

    ddp.zero_grad_buffer()
    store: list[Any] = []
    for i in range(n):
        ctx = ddp.no_sync() if i < n - 1 else contextlib.nullcontext()
        with ctx:
            out, _ = forward_step(step, mine, ddp, n, None, store, config, 1,
                                  current_microbatch=i)
            backward_step(None, out, None, ddp.module.model_type, config)
    ddp.finish_grad_sync()
    return torch.cat([p.main_grad.reshape(-1) for p in ddp.module.parameters()]).tolist()


def full_batch_gradient() -> list[float]:
    net, (x, y) = _net(), _batch()
    torch.nn.functional.mse_loss(net(x.reshape(-1, H)), y.reshape(-1, 1)).backward()
    return torch.cat([p.grad.reshape(-1) for p in net.parameters() if p.grad is not None]).tolist()


def s3(rank: int) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    from greyhound.integrations.megatron import current_parallel_state, parallel_state_builder

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 2)  # as Megatron-LM does: rank r on process r
    shape = ParallelShape(tp=1, dp=2, pp=2)
    before = {"stage": ps.get_pipeline_model_parallel_rank(), "dp": ps.get_data_parallel_rank()}
    old_groups = [ps.get_data_parallel_group(), ps.get_pipeline_model_parallel_group()]
    swap = (0, 2, 1, 3)
    plans = {5: {"version": 1, "gpu_of_rank": list(swap)}, 7: {"version": 2,
                                                                "gpu_of_rank": [0, 1, 2, 3]}}
    job: TorchLayoutFollower | None = None
    fail_on = {"process": 3, "version": 2}
    real = parallel_state_builder()

    def builder(s: ParallelShape, g: Any, t: Any) -> Any:
        groups = real(s, g, t)
        if job is not None and rank == fail_on["process"] and job.seen == fail_on["version"]:
            groups.destroy()
            raise RuntimeError("injected: this process could not build Megatron's groups")
        return groups

    def build_stage(role: Role) -> StageState:
        torch.manual_seed(role.stage)
        module = torch.nn.Linear(4, 4)
        return StageState(module, torch.optim.SGD(module.parameters(), lr=0.1))

    job = TorchLayoutFollower(shape=shape, microbatches=4, build_stage=build_stage,
                              source=lambda: plans.get(job.iteration) if job else None,
                              groups=current_parallel_state(shape), groups_builder=builder,
                              timeout_s=300)
    seen: dict[str, Any] = {}
    for _ in range(9):
        job.next_iteration()
        if job.iteration == 6:  # after version 1
            seen = _megatron_view()
            seen["role"] = [job.role.stage, job.role.dp]
            seen["old_groups_destroyed"] = all(
                g not in torch.distributed.distributed_c10d._world.pg_map for g in old_groups)
    after_failed = _megatron_view()
    job.close()
    return {"before": before, "swapped": seen, "after_failed": after_failed,
            "outcomes": [(o.version, o.applied, o.error) for o in job.history]}


def _megatron_view() -> dict[str, Any]:
    """What Megatron's code sees, and its groups at work: a SUM of process ids over the DP group
    and the first stage's process id sent down the pipeline."""
    from megatron.core import parallel_state as ps

    me = dist.get_rank()
    total = torch.tensor([float(me)])
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    gloo_total = torch.tensor([float(me)])
    dist.all_reduce(gloo_total, group=ps.get_data_parallel_group_gloo())
    got = None
    if ps.is_pipeline_first_stage():
        dist.send(torch.tensor([float(me)]), dst=ps.get_pipeline_model_parallel_next_rank())
    else:
        buf = torch.zeros(1)
        dist.recv(buf, src=ps.get_pipeline_model_parallel_prev_rank())
        got = int(buf.item())
    return {"stage": ps.get_pipeline_model_parallel_rank(), "dp": ps.get_data_parallel_rank(),
            "first": ps.is_pipeline_first_stage(), "last": ps.is_pipeline_last_stage(),
            "next": ps.get_pipeline_model_parallel_next_rank(),
            "prev": ps.get_pipeline_model_parallel_prev_rank(),
            "dp_ranks": list(ps._DATA_PARALLEL_GLOBAL_RANKS),
            "pp_ranks": list(ps._PIPELINE_GLOBAL_RANKS),
            "embedding": ps.is_rank_in_embedding_group(),
            "dp_sum": total.item(), "dp_sum_gloo": gloo_total.item(), "received_from": got}


def main() -> None:
    a = worker_args()
    # The one CUDA call between Megatron's DDP and a CPU build of torch (see the docstring).
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[return-value]
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(1, 1)
    out: dict[str, Any] = {
        "uneven_weighted": s2(a.rank, (1, 7, 3, 5), weighted=True),
        "uneven_megatron_default": s2(a.rank, (1, 7, 3, 5), weighted=False),
        "even": s2(a.rank, (4, 4, 4, 4), weighted=True),
        "full_batch": full_batch_gradient(),
    }
    out["s3"] = s3(a.rank)
    dist.destroy_process_group()
    a.out.write_text(json.dumps(out))
    os._exit(0)


if __name__ == "__main__":
    main()
