"""One rank of the gloo check in test_torch.py (run as ``python -m tests.integrations.torch_worker``).

Phase 1: gradients of an uneven allocation equal the even allocation's and the single-process
full-batch gradient. Phase 2: iteration times healthy, with rank 1 slowed 1.5x (a sleep per
micro-batch), and re-balanced by the S2 allocator from the measured per-micro-batch times.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from greyhound.core.microbatch import allocate_microbatches
from greyhound.integrations.plan_follower import AppliedPlan, MicrobatchPlan
from greyhound.integrations.torch import TorchPlanFollower
from tests.integrations.gloo import worker_args

M, SAMPLES, SLEEP_S, SLOW_RANK, ITERS = 16, 4, 0.06, 1, 7


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(M, SAMPLES, 16, generator=g), torch.randn(M, SAMPLES, 1, generator=g)


def gradients(counts: tuple[int, ...], rank: int, world: int) -> torch.Tensor:
    net, (x, y) = model(), batch()
    follower = TorchPlanFollower(dp_rank=rank, dp_size=world, microbatches=M,
                                 source=MicrobatchPlan(1, counts))
    follower.next_iteration()
    for j in follower.microbatch_slice():
        (torch.nn.functional.mse_loss(net(x[j]), y[j]) * follower.loss_scale).backward()
    follower.allreduce_gradients(net)
    return torch.cat([p.grad.flatten() for p in net.parameters() if p.grad is not None])


def full_batch_gradient() -> torch.Tensor:
    net, (x, y) = model(), batch()
    torch.nn.functional.mse_loss(net(x.reshape(-1, 16)), y.reshape(-1, 1)).backward()
    return torch.cat([p.grad.flatten() for p in net.parameters() if p.grad is not None])


def main() -> None:
    a = worker_args()
    rank, world = a.rank, a.world
    out: dict[str, object] = {}

    even = gradients((4, 4, 4, 4), rank, world)
    uneven = [gradients(c, rank, world) for c in ((1, 7, 3, 5), (10, 2, 2, 2))]
    if rank == 0:
        full = full_batch_gradient()
        out["max_diff_uneven_vs_even"] = max(float((u - even).abs().max()) for u in uneven)
        out["max_diff_even_vs_full_batch"] = float((even - full).abs().max())
        out["grad_norm"] = float(even.norm())

    # Phase 2. The plan source: rank 0 turns the measured per-micro-batch times into a plan.
    net, (x, y) = model(), batch()
    plan: dict[str, MicrobatchPlan | None] = {"current": None}
    applied: list[AppliedPlan] = []
    follower = TorchPlanFollower(dp_rank=rank, dp_size=world, microbatches=M,
                                 source=lambda: plan["current"], on_applied=applied.append)

    def run(slow: bool) -> tuple[list[float], float]:
        iteration_s, per_micro = [], []
        for _ in range(ITERS):
            follower.next_iteration()
            dist.barrier()
            start = time.perf_counter()
            for j in follower.microbatch_slice():
                t0 = time.perf_counter()
                (torch.nn.functional.mse_loss(net(x[j]), y[j]) * follower.loss_scale).backward()
                time.sleep(SLEEP_S * (1.5 if slow and rank == SLOW_RANK else 1.0))
                per_micro.append(time.perf_counter() - t0)
            follower.allreduce_gradients(net)
            iteration_s.append(time.perf_counter() - start)
            net.zero_grad()
        return iteration_s, statistics.median(per_micro)

    healthy, _ = run(slow=False)
    slowed, my_micro_s = run(slow=True)
    times = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(times, torch.tensor([my_micro_s], dtype=torch.float64))
    profile = [float(t) for t in times]
    if rank == 0:
        chosen = allocate_microbatches(profile, M)
        plan["current"] = MicrobatchPlan(2, chosen.counts)
    rebalanced, _ = run(slow=True)
    if rank == 0:
        out.update(
            healthy_s=statistics.median(healthy), slowed_s=statistics.median(slowed),
            rebalanced_s=statistics.median(rebalanced), profile_s=profile,
            counts=list(applied[-1].counts) if applied else None,
            applied=[(p.version, p.iteration, p.cost_s) for p in applied],
        )
    out["rank_counts"] = list(follower.counts)
    out["rank_applied_versions"] = [p.version for p in applied]
    dist.destroy_process_group()
    a.out.write_text(json.dumps(out))
    os._exit(0)


if __name__ == "__main__":
    main()
