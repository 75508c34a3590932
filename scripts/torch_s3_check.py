#!/usr/bin/env python3
"""S3 applied live in a PyTorch job on CPU (gloo): a role swap and a consolidation mid-run.

A pipeline-and-data-parallel model (PP stages x DP groups, 2 x 2 by default, one process per
"GPU") trains with Adam; at ``--swap-at`` the job receives a plan as the planner delivers it
(``gpu_of_rank``, ``swaps``) and applies it without a restart
(greyhound.integrations.torch_layout): new process groups, each moved rank's parameters and
Adam state sent peer to peer, training goes on. Four runs in one job, each from the same seed:

- ``reference``: never swapped;
- ``role_swap``: the S3 role swap the planner's core (greyhound.core.role_swap) makes for a
  congested link on stage 1's DP ring (GPUs 1 and 2 exchange ranks, so each runs the other's
  stage);
- ``consolidate``: the plan greyhound.core.consolidate makes for two stragglers on GPUs 1 and 2
  (one per stage): both gathered into one stage;
- ``failures``: a plan that is not a permutation, the role swap with one process failing to
  build its new groups, the role swap with one process failing to build its new stage, then the
  planner's take-back: each failed version leaves the job on its layout, reported ``failed``
  with the reason.

Losses and parameters after the swap must equal the reference's (float tolerance), the swapped
processes must run each other's stage, the failed versions must change nothing. Prints a table
and, last, ``RESULT {json}`` (loss_max_abs_diff, param_max_abs_diff, swapped_ranks_now_on_stage,
pause_s, ...). Needs PyTorch (``pip install -e '.[torch]'``). Exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HIDDEN, IN, BATCH, LR = 16, 8, 4, 1e-2
TOLERANCE = 1e-6


# ---- one process ---------------------------------------------------------------------------------


def _worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from greyhound.core.consolidate import plan_consolidation
    from greyhound.core.layout import ParallelShape
    from greyhound.core.role_swap import Traffic, plan_role_swap
    from greyhound.integrations.topology import Role
    from greyhound.integrations.torch_groups import build_groups, live_gloo_workers, thread_ids
    from greyhound.integrations.torch_layout import LayoutOutcome, TorchLayoutFollower
    from greyhound.integrations.torch_state import StageState

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # torchrun's RANK, WORLD_SIZE, MASTER_ADDR / _PORT
    world = dist.get_world_size()
    shape = ParallelShape(tp=1, dp=world // a.pp, pp=a.pp)
    me, m_total = dist.get_rank(), a.microbatches

    def build_stage(role: Role) -> StageState:
        torch.manual_seed(100 + role.stage)  # every replica of a stage starts equal
        layers: list[torch.nn.Module] = [torch.nn.Linear(IN if role.stage == 0 else HIDDEN, HIDDEN),
                                         torch.nn.Tanh()]
        if role.stage == shape.pp - 1:
            layers.append(torch.nn.Linear(HIDDEN, 1))
        module = torch.nn.Sequential(*layers)
        return StageState(module, torch.optim.Adam(module.parameters(), lr=LR))

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + step)
        return (torch.randn(m_total, BATCH, IN, generator=g),
                torch.randn(m_total, BATCH, 1, generator=g))

    def train_step(job: TorchLayoutFollower, step: int) -> float:
        """GPipe over the job's current pipeline: all forwards, then all backwards."""
        x, y = batch(step)
        role, groups, module = job.role, job.groups, job.state.module
        last = role.stage == shape.pp - 1
        kept, loss_sum = [], torch.zeros(1)
        for j in job.s2.microbatch_slice():
            if role.stage == 0:
                inp = x[j]
            else:
                inp = torch.empty(BATCH, HIDDEN)
                dist.recv(inp, src=groups.prev)
                inp.requires_grad_()
            out = module(inp)
            if last:
                out = torch.nn.functional.mse_loss(out, y[j]) * job.s2.loss_scale
                loss_sum += out.detach()
            else:
                dist.send(out.detach(), dst=groups.next)
            kept.append((inp, out))
        for inp, out in kept:
            if last:
                out.backward()
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, src=groups.next)
                out.backward(grad)
            if role.stage > 0:
                assert inp.grad is not None
                dist.send(inp.grad, dst=groups.prev)
        job.s2.allreduce_gradients(module)
        assert job.state.optimizer is not None
        job.state.optimizer.step()
        job.state.optimizer.zero_grad()
        dist.all_reduce(loss_sum)  # the global batch's mean loss, on every process
        return float(loss_sum.item())

    def run(name: str, deliveries: dict[int, dict[str, Any]],
            faults: dict[str, tuple[int, int]] | None = None) -> dict[str, Any]:
        faults = faults or {}
        reports: list[LayoutOutcome] = []
        job: TorchLayoutFollower | None = None

        def source() -> dict[str, Any] | None:
            assert job is not None
            due = [v for it, v in deliveries.items() if it <= job.iteration]
            return due[-1] if due else None

        def builder(s: ParallelShape, g: Any, timeout: Any) -> Any:
            groups = build_groups(s, g, timeout=timeout)
            at = faults.get("groups")
            if job is not None and at and me == at[0] and job.seen == at[1]:
                groups.destroy()
                raise RuntimeError("injected: communicator init failed on this process")
            return groups

        def stage(role: Role) -> StageState:
            at = faults.get("stage")
            if job is not None and at and me == at[0] and job.seen == at[1]:
                raise RuntimeError(f"injected: out of memory building stage {role.stage}")
            return build_stage(role)

        threads_before = thread_ids()
        job = TorchLayoutFollower(shape=shape, microbatches=m_total, build_stage=stage,
                                  source=source, on_report=reports.append, groups_builder=builder,
                                  timeout_s=a.timeout)
        losses, stages = [], []
        for step in range(a.steps):
            job.next_iteration()
            stages.append(job.role.stage)
            losses.append(train_step(job, step))
        flat = torch.cat([p.detach().reshape(-1) for p in job.state.module.parameters()])
        mine = (job.role.stage, job.role.dp, flat.tolist())
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine)
        everyone_stages: list[Any] = [None] * world
        dist.all_gather_object(everyone_stages, stages)
        job.close()
        # Every group the follower made went with close(), its threads joined: one left would
        # be torn down at interpreter shutdown, where gloo can abort (ParallelGroups.destroy).
        if left := live_gloo_workers(besides=threads_before):
            raise SystemExit(f"process {me}, run {name}: {left} gloo worker threads outlive "
                             "TorchLayoutFollower.close(): a group it made is still referenced")
        return {"name": name, "losses": losses, "params": every, "stages": everyone_stages,
                "outcomes": [asdict(o) for o in job.history],
                "reports": [asdict(o) for o in reports], "gpu_of_rank": list(job.gpu_of_rank)}

    swap = plan_role_swap(shape, 1, {(shape.world - 2, shape.world - 1): 4.0},
                          Traffic(1e9, 1e7, m_total))
    cons = plan_consolidation(shape, {1: 1.5, shape.world - 2: 1.5},
                              microbatches=m_total // shape.dp)

    def delivery(version: int, gpus: Any, swaps: Any) -> dict[str, Any]:
        return {"version": version, "strategy": "S3", "action": "apply", "microbatches": None,
                "gpu_of_rank": None if gpus is None else list(gpus),
                "swaps": [list(p) for p in swaps]}

    k = a.swap_at
    runs = [
        run("reference", {}),
        run("role_swap", {k: delivery(1, swap.gpu_of_rank, swap.swaps)}),
        run("consolidate", {k: delivery(1, cons.gpu_of_rank, cons.swaps)}),
        run("failures", {k: delivery(1, [0] * shape.world, []),
                         k + 1: delivery(2, swap.gpu_of_rank, swap.swaps),
                         k + 2: delivery(3, swap.gpu_of_rank, swap.swaps),
                         k + 3: delivery(4, None, [])},
            faults={"groups": (shape.world - 1, 2), "stage": (swap.swaps[0][0], 3)}),
    ]
    if me == 0:
        plans = {"role_swap": {"node_pairs": swap.node_pairs, "swaps": swap.swaps,
                               "gpu_of_rank": swap.gpu_of_rank},
                 "consolidate": {"swaps": cons.swaps, "cells": cons.cells,
                                 "gpu_of_rank": cons.gpu_of_rank}}
        a.out.write_text(json.dumps({"runs": runs, "plans": plans, "tp": 1, "dp": shape.dp,
                                     "pp": shape.pp, "swap_at": k}, default=list))
    dist.destroy_process_group()
    # torch itself keeps the default group referenced once torch._dynamo is imported (an
    # optimizer imports it), so its gloo workers live on into interpreter shutdown; one still
    # releasing the last collective then aborts the process (pytorch/pytorch#190489). The
    # follower's own groups are gone (checked in run()); the job ends without the shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---- the launcher ----------------------------------------------------------------------------------


def _launch(a: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The job as users start theirs: torchrun, one process per "GPU", gloo on loopback."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(a.procs), __file__, "--worker", "--pp", str(a.pp), "--steps", str(a.steps),
           "--swap-at", str(a.swap_at), "--microbatches", str(a.microbatches), "--timeout",
           str(a.timeout), "--out", str(out)]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"the {a.procs} processes did not finish within {a.timeout:.0f} s") from None
    if done.returncode != 0:
        raise SystemExit(f"torchrun exited {done.returncode}:\n{done.stdout[-4000:]}"
                         f"{done.stderr[-4000:]}")
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def _params_by_stage(run: dict[str, Any]) -> dict[int, list[list[float]]]:
    out: dict[int, list[list[float]]] = {}
    for stage, _dp, flat in run["params"]:
        out.setdefault(stage, []).append(flat)
    return out


def _max_diff(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def summarise(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The figures and every check that failed (empty: all passed)."""
    runs = {r["name"]: r for r in data["runs"]}
    ref, k = runs["reference"], data["swap_at"]
    ref_params = _params_by_stage(ref)
    problems: list[str] = []
    figures: dict[str, Any] = {}
    loss_diff = param_diff = 0.0
    for name in ("role_swap", "consolidate", "failures"):
        run = runs[name]
        d_loss = max(abs(x - y) for x, y in zip(run["losses"], ref["losses"], strict=True))
        d_param = max(_max_diff(p, ref_params[s][0])
                      for s, ps in _params_by_stage(run).items() for p in ps)
        figures[name] = {"loss_max_abs_diff": d_loss, "param_max_abs_diff": d_param,
                         "gpu_of_rank": run["gpu_of_rank"],
                         "outcomes": [{k2: o[k2] for k2 in ("version", "applied", "cost_s", "error",
                                                            "moved", "bytes_moved")}
                                      for o in run["outcomes"]]}
        loss_diff, param_diff = max(loss_diff, d_loss), max(param_diff, d_param)
        if d_loss > TOLERANCE or d_param > TOLERANCE:
            problems.append(f"{name}: differs from the reference (loss {d_loss:.3g}, "
                            f"parameters {d_param:.3g})")
    swap = runs["role_swap"]
    pairs = data["plans"]["role_swap"]["swaps"]
    stages = swap["stages"]
    now_on = {str(p): stages[p][-1] for pair in pairs for p in pair}
    for a_, b_ in pairs:
        if not (stages[a_][k] == stages[b_][k - 1] and stages[b_][k] == stages[a_][k - 1]
                and stages[a_][k - 1] != stages[b_][k - 1]):
            problems.append(f"role_swap: processes {a_} and {b_} do not run each other's stage "
                            f"after the swap ({stages[a_]}, {stages[b_]})")
    outcome = swap["outcomes"][0] if swap["outcomes"] else None
    if not (outcome and outcome["applied"]):
        problems.append(f"role_swap: not applied: {outcome}")
    cons = runs["consolidate"]
    cells = data["plans"]["consolidate"]["cells"]
    straggler_stages = {cons["stages"][g][-1] for g in (1, len(stages) - 2)}
    if len(straggler_stages) != 1 or not (cons["outcomes"] and cons["outcomes"][0]["applied"]):
        problems.append(f"consolidate: the stragglers run stages {sorted(straggler_stages)}")
    fails = runs["failures"]
    got = [(o["version"], o["applied"]) for o in fails["outcomes"]]
    if got != [(1, False), (2, False), (3, False), (4, True)]:
        problems.append(f"failures: outcomes {got}, expected v1-v3 failed and v4 applied")
    if any(len(set(s)) != 1 for s in fails["stages"]):
        problems.append("failures: a process changed stage although every plan failed")
    if [r["version"] for r in fails["reports"]] != [1, 2, 3, 4]:
        problems.append(f"failures: rank 0 reported {fails['reports']}")
    pause = outcome["cost_s"] if outcome else None
    result = {
        "loss_max_abs_diff": loss_diff, "param_max_abs_diff": param_diff,
        "swapped_ranks_now_on_stage": now_on, "pause_s": pause,
        "consolidate_pause_s": cons["outcomes"][0]["cost_s"] if cons["outcomes"] else None,
        "consolidate_straggler_stages": sorted(straggler_stages), "consolidate_cells": cells,
        "loss_before_swap": {"reference": ref["losses"][k - 1], "role_swap": swap["losses"][k - 1]},
        "loss_last": {"reference": ref["losses"][-1], "role_swap": swap["losses"][-1],
                      "consolidate": cons["losses"][-1]},
        "bytes_moved": outcome["bytes_moved"] if outcome else None,
        "failures": [{"version": o["version"], "error": o["error"]} for o in fails["outcomes"]],
        "ok": not problems,
    }
    return {"result": result, "figures": figures, "runs": runs}, problems


def _print(summary: dict[str, Any], data: dict[str, Any]) -> None:
    runs, k = summary["runs"], data["swap_at"]
    print(f"PP {data['pp']} x DP {data['dp']} on gloo; plan at iteration {k}")
    print(f"{'iteration':>9} " + " ".join(f"{n:>14}" for n in runs))
    for i in range(len(runs["reference"]["losses"])):
        mark = " <- plan" if i == k else ""
        print(f"{i:>9} " + " ".join(f"{r['losses'][i]:14.8f}" for r in runs.values()) + mark)
    for name, f in summary["figures"].items():
        print(f"{name}: layout {f['gpu_of_rank']}, loss diff {f['loss_max_abs_diff']:.3g}, "
              f"parameter diff {f['param_max_abs_diff']:.3g}")
        for o in f["outcomes"]:
            state = "applied" if o["applied"] else "failed"
            print(f"  v{o['version']} {state} in {o['cost_s'] * 1000:.1f} ms, moved to processes "
                  f"{o['moved']} ({o['bytes_moved']} bytes){': ' + o['error'] if o['error'] else ''}")
    print("stage run by each process, per iteration (role_swap):")
    for p, s in enumerate(runs["role_swap"]["stages"]):
        print(f"  process {p}: {s}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=4, help="processes (PP x DP), default 4")
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages, default 2")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--swap-at", type=int, default=5, help="iteration the plan arrives at")
    ap.add_argument("--microbatches", type=int, default=4, help="M per iteration (global)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds for the whole run")
    ap.add_argument("--json-out", type=Path, default=None, help="write the full figures here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        _worker(a)
        return 0
    if a.procs % a.pp or a.procs // a.pp < 2 or a.pp < 2:
        ap.error("--procs must be --pp (>= 2) times a DP size >= 2")
    if not 1 <= a.swap_at <= a.steps - 4:
        ap.error("--swap-at must leave 4 iterations after it (the failure run uses them)")
    if a.microbatches % (a.procs // a.pp):
        ap.error("--microbatches must be a multiple of the DP size")
    with tempfile.TemporaryDirectory(prefix="greyhound-s3-") as tmp:
        data = _launch(a, Path(tmp) / "result.json")
    summary, problems = summarise(data)
    _print(summary, data)
    if a.json_out is not None:
        a.json_out.write_text(json.dumps({**summary, "data": data}, default=list))
    for p in problems:
        print(f"FAILED: {p}")
    print("RESULT " + json.dumps(summary["result"]))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
