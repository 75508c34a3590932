"""Megatron-core's own hook points for S2 and S3 (``megatron-core`` from PyPI, imported here only).

S2, micro-batches per DP group (greyhound.integrations.plan_follower):

* the micro-batch calculator: :func:`follow_microbatches` puts the follower behind
  ``megatron.core.num_microbatches_calculator.get_num_microbatches()``, which the training step
  reads and hands the pipeline schedule, so DP group i runs m_i micro-batches; the global batch
  and micro-batch sizes stay what the job configured;
* the gradient: the schedule divides each micro-batch's loss by that count, and Megatron's DDP
  multiplies each bucket by ``gradient_scaling_factor`` (1 / dp with
  ``average_in_collective=False``) before a SUM over the DP group; :func:`set_gradient_weight`
  makes it m_i / M, so the SUM is again the whole global batch's mean gradient. An averaging
  reduction (``average_in_collective=True``) cannot be weighted and is refused.

S3, ranks moved between processes (greyhound.integrations.torch_layout): Megatron derives every
group from ``torch.distributed.get_rank()`` in ``parallel_state.initialize_model_parallel``, rank
r being process r. :func:`parallel_state_builder` makes a ``TorchLayoutFollower`` groups builder
that re-runs that function with rank r played by process ``gpu_of_rank[r]`` (during the call,
``get_rank()`` answers the process's rank and each group's ranks are mapped to processes), maps
the global-rank lists it keeps (pipeline, data-parallel, embedding ranks...) to processes, and
sets its rank overrides (``set_pipeline_model_parallel_rank`` and the like) to the process's new
coordinates, since torch orders a group's members by process. The new groups are built beside
the old ones with the old state put back; :meth:`MegatronGroups.activate` swaps the module's
state in when every process has built them, and the old groups are then destroyed. Context and
expert parallelism are not covered (a layout of TP x DP x PP only).

What must be built again after a change is whatever captured a group: the model chunk of a
process that changes stage (``build_stage``), the DDP wrapper and the optimizer (their buffers
and reductions are bound to the data-parallel group) on every process whose groups changed.
"""

from __future__ import annotations

import importlib.util
import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from greyhound.core.layout import ParallelShape
from greyhound.integrations.plan_follower import PlanFollower
from greyhound.integrations.topology import group_members, roles
from greyhound.integrations.torch_groups import ParallelGroups

PS_MODULE = "megatron.core.parallel_state"


# ---- S2 ---------------------------------------------------------------------------------------


class FollowerCalculator:
    """Megatron's micro-batch calculator with the follower's count for this rank's DP group;
    batch sizes and ramp-up updates stay the wrapped calculator's. While a ramp-up makes the
    global batch hold another number of micro-batches than the follower's M, the wrapped
    calculator's own (even) count stands: the plan was made for M."""

    def __init__(self, inner: Any, follower: PlanFollower) -> None:
        self.inner, self.follower = inner, follower

    def global_microbatches(self) -> int:
        return int(self.inner.get_current_running_global_batch_size()
                   // self.inner.get_micro_batch_size())

    def get(self) -> int:
        if self.global_microbatches() != self.follower.total:
            return int(self.inner.get())
        return self.follower.microbatches

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def follow_microbatches(follower: PlanFollower) -> FollowerCalculator:
    """Install the follower behind ``get_num_microbatches()`` (after Megatron initialised its
    calculator: ``init_num_microbatches_calculator``); M must be the global batch's
    micro-batches, global batch size / micro-batch size."""
    from megatron.core import num_microbatches_calculator as nmc

    inner = nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR
    if inner is None:
        raise RuntimeError("Megatron's micro-batch calculator is not initialised "
                           "(init_num_microbatches_calculator)")
    if isinstance(inner, FollowerCalculator):
        inner = inner.inner
    calc = FollowerCalculator(inner, follower)
    if calc.global_microbatches() != follower.total:
        raise ValueError(f"the follower splits {follower.total} micro-batches, Megatron's global "
                         f"batch holds {calc.global_microbatches()}")
    nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR = calc
    return calc


def set_gradient_weight(ddp: Any, weight: float) -> None:
    """Every bucket of a Megatron ``DistributedDataParallel`` scales by ``weight`` (m_i / M)
    before its SUM over the DP group; call it whenever the follower's count changes."""
    if ddp.ddp_config.average_in_collective:
        raise ValueError("average_in_collective=True averages over the DP group and cannot weight "
                         "uneven micro-batch counts; use average_in_collective=False")
    for group in [*ddp.bucket_groups, *ddp.expert_parallel_bucket_groups]:
        for bucket in group.buckets:
            bucket.gradient_scaling_factor = float(weight)


# ---- S3 ---------------------------------------------------------------------------------------


def _pristine() -> dict[str, Any]:
    """parallel_state's module-level state as a fresh import has it (None, {} ...): its
    top level run again in a private module, so no name or initial value is guessed here."""
    spec = importlib.util.find_spec(PS_MODULE)
    if spec is None or spec.loader is None:
        raise ImportError(f"{PS_MODULE} not found (pip install megatron-core)")
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    return {k: v for k, v in vars(fresh).items()
            if k.startswith("_") and not k.startswith("__") and not callable(v)
            and not isinstance(v, types.ModuleType)}


_PRISTINE: dict[str, Any] | None = None


def _ps() -> Any:
    from megatron.core import parallel_state

    return parallel_state


def snapshot() -> dict[str, Any]:
    """parallel_state's current groups, ranks and overrides."""
    global _PRISTINE
    if _PRISTINE is None:
        _PRISTINE = _pristine()
    ps = _ps()
    return {k: getattr(ps, k) for k in _PRISTINE}


def restore(state: dict[str, Any]) -> None:
    ps = _ps()
    for k, v in state.items():
        setattr(ps, k, v)


def _reset() -> None:
    snapshot()
    assert _PRISTINE is not None
    restore({k: (type(v)() if isinstance(v, dict | list) else v) for k, v in _PRISTINE.items()})


@contextmanager
def _as_roles(gpu_of_rank: Sequence[int]) -> Iterator[None]:
    """During Megatron's group building: rank r is process gpu_of_rank[r]."""
    real_rank, real_new = dist.get_rank, dist.new_group
    rank_of = {int(g): r for r, g in enumerate(gpu_of_rank)}
    mine = rank_of[real_rank()]

    def get_rank(group: Any = None) -> int:
        return mine if group is None else real_rank(group)

    def new_group(ranks: Sequence[int] | None = None, *args: Any, **kwargs: Any) -> Any:
        mapped = None if ranks is None else [int(gpu_of_rank[r]) for r in ranks]
        return real_new(mapped, *args, **kwargs)

    torch.distributed.get_rank = get_rank
    torch.distributed.new_group = new_group
    try:
        yield
    finally:
        torch.distributed.get_rank = real_rank
        torch.distributed.new_group = real_new


class MegatronGroups(ParallelGroups):
    """One layout's Megatron groups: parallel_state as it must read under that layout."""

    state: dict[str, Any]

    def activate(self) -> None:
        restore(self.state)

    def destroy(self) -> None:
        """Destroy the layout's groups and forget them (ParallelGroups.destroy says why): when
        this is the state parallel_state runs (the follower's close), parallel_state is reset
        as ``destroy_model_parallel`` leaves it, not left pointing at destroyed groups."""
        ps = _ps()
        listed = self.state.get("_global_process_group_list")
        live = ps.torch.distributed.distributed_c10d._world.pg_map
        for pg in listed or []:
            if pg is not None and pg in live:
                dist.destroy_process_group(pg)
        if listed is not None and getattr(ps, "_global_process_group_list", None) is listed:
            _reset()
        self.state = {}
        self.tp = self.dp = self.pp = None


def build_parallel_state(shape: ParallelShape, gpu_of_rank: Sequence[int], *,
                         timeout: timedelta | None = None, **init: Any) -> MegatronGroups:
    """parallel_state for ``gpu_of_rank``, built beside the one in use (which is left in place:
    :meth:`MegatronGroups.activate` switches). ``init``: initialize_model_parallel's other
    arguments (sizes come from ``shape``)."""
    for key in ("context_parallel_size", "expert_model_parallel_size"):
        if init.get(key, 1) != 1:
            raise ValueError(f"{key} {init[key]}: only TP x DP x PP layouts are rebuilt")
    if init.get("order", "tp-cp-ep-dp-pp") not in ("tp-cp-ep-dp-pp", "tp-dp-pp"):
        raise ValueError(f"order {init['order']!r}: ranks must follow tp + TP * (dp + DP * pp)")
    ps = _ps()
    if timeout is not None:
        init.setdefault("distributed_timeout_minutes", max(1, round(timeout.total_seconds() / 60)))
    before = snapshot()
    _reset()
    try:
        with _as_roles(gpu_of_rank):
            ps.initialize_model_parallel(tensor_model_parallel_size=shape.tp,
                                         pipeline_model_parallel_size=shape.pp, **init)
        for k, v in snapshot().items():
            if "RANKS" in k and isinstance(v, list) and all(isinstance(x, int) for x in v):
                setattr(ps, k, [int(gpu_of_rank[r]) for r in v])
        role = roles(shape, gpu_of_rank)[dist.get_rank()]
        ps.set_tensor_model_parallel_rank(role.tp)
        ps.set_pipeline_model_parallel_rank(role.stage)
        ps.set_data_parallel_rank(role.dp)
        built = snapshot()
    except BaseException:
        half = MegatronGroups(roles(shape, gpu_of_rank)[dist.get_rank()], tuple(gpu_of_rank),
                              {}, None, None, None)
        half.state = snapshot()
        half.destroy()
        restore(before)
        raise
    restore(before)
    every = group_members(shape, gpu_of_rank)
    members = {kind: next(g for g in every[kind] if dist.get_rank() in g) for kind in every}
    groups = MegatronGroups(role, tuple(int(g) for g in gpu_of_rank), members,
                            built["_TENSOR_MODEL_PARALLEL_GROUP"], built["_DATA_PARALLEL_GROUP"],
                            built["_PIPELINE_MODEL_PARALLEL_GROUP"])
    groups.state = built
    return groups


def current_parallel_state(shape: ParallelShape) -> MegatronGroups:
    """The parallel_state Megatron initialised itself (rank r on process r), as the follower's
    first groups (``TorchLayoutFollower(groups=...)``), so that the first change destroys it."""
    ps = _ps()
    if not ps.model_parallel_is_initialized():
        raise RuntimeError("Megatron's parallel_state is not initialised")
    identity = tuple(range(shape.world))
    every = group_members(shape, identity)
    me = dist.get_rank()
    groups = MegatronGroups(roles(shape, identity)[me], identity,
                            {k: next(g for g in every[k] if me in g) for k in every},
                            ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group(),
                            ps.get_pipeline_model_parallel_group())
    groups.state = snapshot()
    return groups


def parallel_state_builder(**init: Any) -> Any:
    """A ``TorchLayoutFollower`` ``groups_builder`` that rebuilds Megatron's parallel_state."""
    def build(shape: ParallelShape, gpu_of_rank: Sequence[int], timeout: timedelta) -> MegatronGroups:
        return build_parallel_state(shape, gpu_of_rank, timeout=timeout, **dict(init))

    return build
