"""S3 inside a running PyTorch job: change which process runs which rank, without a restart.

Between iterations (the loop calls :meth:`TorchLayoutFollower.next_iteration`), global rank 0
asks for the job's current delivery and broadcasts it, so every process acts on the same
version at the same boundary, as the S2 follower does. A delivery is absolute (micro-batches per
DP group, rank -> process map); a version above the one the job runs is applied:

1. checks, the same on every process (they hold the same message): counts that fit the job, a
   permutation of the processes, TP groups (and DP groups under a sharded optimizer) that torch
   can keep in order (greyhound.integrations.topology);
2. the new layout's TP, DP and PP groups, created beside the ones in use;
3. the moves: each process whose rank's state it does not hold receives it from the process
   that ran that rank (its module, optimizer and extras, one buffer, peer to peer), builds its
   new stage with ``build_stage`` and loads it; the state it ran stays untouched meanwhile;
4. a vote after steps 2 and 3: if every process succeeded the new groups and stages become the
   job's and the old groups are destroyed; otherwise every process drops what it built and
   trains on in the old layout, and the version is reported ``failed`` with each failing
   process's reason (the planner then delivers the previous layout back).

The pause the version cost (the slowest process's time from the boundary to training again) is
reported as ``cost_s`` with ``applied``: the planner learns S3's overhead from it
(docs/mitigation.md). Reports go from global rank 0 only, to ``on_report``
(``PlanClient.on_outcome`` posts them); a report that fails is a warning, never an exception
in the loop. Micro-batch counts (S2) are followed too, over the current DP group, through the
embedded :class:`~greyhound.integrations.torch.TorchPlanFollower` (:attr:`s2`: its slices, loss
scale and reduction; this follower fetches and adopts, so its own ``next_iteration`` is not called).

Use (a stage-building function gives each rank its module and optimizer)::

    def build_stage(role):                  # role.stage, role.dp, role.tp
        module = make_stage(role.stage)
        return StageState(module, torch.optim.Adam(module.parameters()))

    job = TorchLayoutFollower(shape=ParallelShape(tp=1, dp=2, pp=2), microbatches=8,
                              build_stage=build_stage, source=client.fetch_delivery,
                              on_report=client.on_outcome)
    for step in range(steps):
        job.next_iteration()
        ...  # job.state.module, job.groups.prev / .next for activations,
             # job.s2.microbatch_slice() for the data, job.s2.allreduce_gradients(module)
        job.state.optimizer.step()

Anything bound to a process group (torch's ``DistributedDataParallel``, a Megatron DDP wrapper)
must be built again after a layout change: ``build_stage`` does that for processes that take a
new stage, ``on_layout`` (called on every process after a change) for the others.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from greyhound.core.layout import ParallelShape
from greyhound.core.plans import even_split
from greyhound.integrations.plan_follower import MicrobatchPlan
from greyhound.integrations.topology import (
    Delivery,
    LayoutError,
    LayoutOutcome,
    Role,
    check_group_order,
    layout,
    roles,
    transfers,
)
from greyhound.integrations.torch import TorchPlanFollower
from greyhound.integrations.torch_groups import ParallelGroups, build_groups
from greyhound.integrations.torch_state import StageState, exchange

__all__ = ["Delivery", "LayoutOutcome", "Role", "StageState", "TorchLayoutFollower"]

log = logging.getLogger(__name__)

DeliverySource = Callable[[], Delivery | Mapping[str, Any] | None]
GroupsBuilder = Callable[[ParallelShape, Sequence[int], timedelta], ParallelGroups]


class TorchLayoutFollower:
    """One process's side of a TP x DP x PP job that follows S2 and S3 plans."""

    def __init__(
        self,
        *,
        shape: ParallelShape,
        microbatches: int,
        build_stage: Callable[[Role], StageState],
        source: DeliverySource | None = None,
        on_report: Callable[[LayoutOutcome], None] | None = None,
        on_error: Callable[[Exception], None] | None = None,
        on_layout: Callable[[TorchLayoutFollower], None] | None = None,
        state: StageState | None = None,
        gpu_of_rank: Sequence[int] | None = None,
        multiple_of: int = 1,
        replicated_dp: bool = True,
        timeout_s: float = 300.0,
        device: torch.device | str = "cpu",
        backend: str | None = None,
        groups_builder: GroupsBuilder | None = None,
        groups: ParallelGroups | None = None,
    ) -> None:
        if dist.get_world_size() != shape.world:
            raise ValueError(f"the job's world has {dist.get_world_size()} processes, the layout "
                             f"tp {shape.tp} x dp {shape.dp} x pp {shape.pp} needs {shape.world}")
        self.shape, self.total, self.multiple_of = shape, microbatches, multiple_of
        self.me = dist.get_rank()
        self.device = torch.device(device)
        self.replicated_dp = replicated_dp
        self.timeout = timedelta(seconds=timeout_s)
        self._build_stage, self._source = build_stage, source
        self._on_report, self._on_layout = on_report, on_layout
        self._on_error = on_error or (lambda e: log.warning("greyhound plan: %s", e))
        self._order = ("tp",) if replicated_dp else ("tp", "dp")
        self._groups_builder = groups_builder or (
            lambda s, g, t: build_groups(s, g, timeout=t, backend=backend))
        self.gpu_of_rank = layout(shape, gpu_of_rank)
        check_group_order(shape, self.gpu_of_rank, self._order)
        # Votes and moves go over a group of their own, with its own timeout: a process that
        # fails half-way must not leave the others blocked for the job's (long) default one.
        self.control: Any = dist.new_group(list(range(shape.world)), timeout=self.timeout,
                                           backend=backend)
        if groups is not None and groups.gpu_of_rank != self.gpu_of_rank:
            raise ValueError(f"groups built for layout {list(groups.gpu_of_rank)}, the job runs "
                             f"{list(self.gpu_of_rank)}")
        self.groups = groups or self._groups_builder(shape, self.gpu_of_rank, self.timeout)
        self.groups.activate()
        self.state = state if state is not None else build_stage(self.role)
        self.s2 = self._s2(even_split(microbatches, shape.dp, multiple_of))
        self.version = 0  # the version the job runs (0: its own layout)
        self.seen = 0  # the highest version acted on (being applied, applied or failed)
        self.iteration = 0
        self.history: list[LayoutOutcome] = []

    def close(self) -> None:
        """Destroy the groups this follower made (the job's own default group stays) and drop
        its references to them, so that they go now and not at interpreter shutdown, where gloo
        can abort the process (ParallelGroups.destroy); the follower is not used after this."""
        if self.control is None:
            return
        self.groups.destroy()
        dist.destroy_process_group(self.control)
        self.control = None
        self.s2.group = None

    @property
    def role(self) -> Role:
        return roles(self.shape, self.gpu_of_rank)[self.me]

    def next_iteration(self) -> int:
        """At an iteration boundary: agree on the delivery, apply a new version; returns m_i."""
        if self.control is None:
            raise RuntimeError("this TorchLayoutFollower was closed")
        start = time.perf_counter()
        delivery, problem = self._agree(self._fetch() if self.me == 0 else None)
        if delivery is not None and delivery.version > self.seen:
            self.seen = delivery.version
            outcome = self._apply(delivery, problem, start)
            self.history.append(outcome)
            if self.me == 0 and self._on_report is not None:
                try:
                    self._on_report(outcome)
                except Exception as exc:  # a failing report must not stop training
                    self._on_error(exc)
        self.iteration += 1
        return self.s2.microbatches

    # ---- one version ---------------------------------------------------------------------------

    def _apply(self, d: Delivery, problem: str | None, start: float) -> LayoutOutcome:
        error, nbytes, changed = problem, 0, False
        moved: tuple[int, ...] = ()
        counts = target = None
        if error is None:
            try:
                counts = self._counts(d)
                target = layout(self.shape, d.gpu_of_rank)
                check_group_order(self.shape, target, self._order)
            except (ValueError, LayoutError) as exc:
                error = f"plan v{d.version} does not fit the job: {exc}"
        if error is None and target is not None and target != self.gpu_of_rank:
            changed = True
            error, moved, nbytes = self._reconfigure(target)
        if error is None and counts is not None:
            self.s2.counts, self.s2.version = counts, d.version
            self.version = d.version
        cost = self._max(time.perf_counter() - start)
        if error is not None:
            log.warning("greyhound plan v%d failed, the job keeps its layout: %s", d.version, error)
        return LayoutOutcome(d.version, error is None, cost, error, self.iteration,
                             changed and error is None, moved, nbytes)

    def _counts(self, d: Delivery) -> tuple[int, ...]:
        if d.microbatches is None:
            return even_split(self.total, self.shape.dp, self.multiple_of)
        return self.s2.check(MicrobatchPlan(d.version, d.microbatches)).counts

    def _reconfigure(self, target: tuple[int, ...]) -> tuple[str | None, tuple[int, ...], int]:
        """Steps 2-4 of the module docstring; (None or why it failed, movers, bytes moved)."""
        moves = transfers(self.shape, self.gpu_of_rank, target, replicated_dp=self.replicated_dp)
        new_groups: ParallelGroups | None = None
        new_state: StageState | None = None
        nbytes = 0
        failed = None
        try:
            new_groups = self._groups_builder(self.shape, target, self.timeout)
        except Exception as exc:
            failed = f"process {self.me}: building the new process groups: {exc!r}"
        failed = self._vote(failed)
        if failed is None:
            err = None
            rank = roles(self.shape, target)[self.me].rank
            try:
                tree, nbytes = exchange(moves, self.me, self.state, group=self.control,
                                        device=self.device, timeout=self.timeout)
                if tree is not None:
                    new_state = self._build_stage(roles(self.shape, target)[self.me])
                    new_state.load_state_dict(tree)
            except Exception as exc:
                err = f"process {self.me}: moving state to rank {rank}: {exc!r}"
            failed = self._vote(err)
        if failed is not None:
            if new_groups is not None:
                new_groups.destroy()
            return failed, (), 0
        assert new_groups is not None
        old, self.groups, self.gpu_of_rank = self.groups, new_groups, target
        if new_state is not None:
            self.state = new_state
        new_groups.activate()
        old.destroy()
        counts, version = self.s2.counts, self.s2.version
        self.s2 = self._s2(counts)
        self.s2.version = version
        if self._on_layout is not None:
            self._on_layout(self)
        return None, tuple(m.dst for m in moves), self._sum(nbytes)

    # ---- agreement -----------------------------------------------------------------------------

    def _fetch(self) -> Delivery | None:
        if self._source is None:
            return None
        try:
            raw = self._source()
            return None if raw is None else Delivery.parse(raw)
        except Exception as exc:  # a broken plan source must never stop training
            self._on_error(exc)
            return None

    def _agree(self, d: Delivery | None) -> tuple[Delivery | None, str | None]:
        """Rank 0's delivery on every process, as one int64 tensor: [flag, version, has counts,
        has layout, counts (DP), layout (world)]; flag 2 is a delivery whose sizes do not fit
        (its reason stays with rank 0, the one that reports)."""
        dp, world = self.shape.dp, self.shape.world
        msg = torch.full((4 + dp + world,), -1, dtype=torch.int64, device=self.device)
        problem = None
        if d is not None:
            ok_counts = d.microbatches is None or len(d.microbatches) == dp
            ok_layout = d.gpu_of_rank is None or len(d.gpu_of_rank) == world
            msg[0], msg[1] = (1 if ok_counts and ok_layout else 2), d.version
            if not ok_counts:
                problem = f"plan v{d.version}: {len(d.microbatches or ())} counts for {dp} DP groups"
            elif not ok_layout:
                problem = (f"plan v{d.version}: gpu_of_rank has {len(d.gpu_of_rank or ())} entries "
                           f"for {world} processes")
            else:
                msg[2], msg[3] = d.microbatches is not None, d.gpu_of_rank is not None
                if d.microbatches is not None:
                    msg[4 : 4 + dp] = torch.tensor(d.microbatches, dtype=torch.int64)
                if d.gpu_of_rank is not None:
                    msg[4 + dp :] = torch.tensor(d.gpu_of_rank, dtype=torch.int64)
        dist.broadcast(msg, src=0, group=self.control)
        v = [int(x) for x in msg.tolist()]
        if v[0] == -1:
            return None, None
        if v[0] == 2:
            return Delivery(v[1]), problem or f"plan v{v[1]} does not fit the job's sizes"
        counts = tuple(v[4 : 4 + dp]) if v[2] else None
        gpus = tuple(v[4 + dp :]) if v[3] else None
        return Delivery(v[1], counts, gpus), None

    def _vote(self, error: str | None) -> str | None:
        """Every process's error, or None when all succeeded (the same answer everywhere)."""
        errors: list[str | None] = [None] * self.shape.world
        dist.all_gather_object(errors, error, group=self.control)
        bad = [e for e in errors if e is not None]
        return "; ".join(bad) if bad else None

    def _max(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return float(t.item())

    def _sum(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.control)
        return int(t.item())

    def _s2(self, counts: tuple[int, ...]) -> TorchPlanFollower:
        s2 = TorchPlanFollower(dp_rank=self.role.dp, dp_size=self.shape.dp,
                               microbatches=self.total, group=self.groups.dp, device=self.device)
        s2.counts = counts
        return s2
