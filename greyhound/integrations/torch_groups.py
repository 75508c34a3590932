"""A process's TP, DP and PP process groups for one layout of ranks on processes.

``torch.distributed.new_group`` is collective over the whole world: every process creates every
group, in the same order, members or not (greyhound.integrations.topology.group_members gives
that order). A layout's groups are built beside the ones in use and only become the job's when
every process has built them, so a failure leaves the old ones in place; the old ones are then
destroyed.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from greyhound.core.layout import ParallelShape
from greyhound.integrations.topology import GROUP_KINDS, Role, group_members, roles


@dataclass
class ParallelGroups:
    """This process's groups under one layout, with their members (processes, in role order)."""

    role: Role
    gpu_of_rank: tuple[int, ...]
    members: dict[str, tuple[int, ...]]
    tp: Any
    dp: Any
    pp: Any
    created: list[Any] = field(default_factory=list)

    @property
    def prev(self) -> int | None:
        """The process running the previous stage of this pipeline (None on the first stage)."""
        s = self.role.stage
        return self.members["pp"][s - 1] if s > 0 else None

    @property
    def next(self) -> int | None:
        """The process running the next stage of this pipeline (None on the last stage)."""
        s, pp = self.role.stage, self.members["pp"]
        return pp[s + 1] if s + 1 < len(pp) else None

    def activate(self) -> None:
        """Make these the job's groups; plain torch has nothing global to switch (Megatron's
        parallel_state does: greyhound.integrations.megatron)."""

    def destroy(self) -> None:
        """Destroy this layout's groups and drop every reference this object holds to them.

        A ProcessGroup's C++ side (gloo's worker threads) goes only with its last Python
        reference. One still referenced at interpreter shutdown is torn down there, where a gloo
        worker releasing a finished collective's tensors needs the GIL that a finalising
        interpreter no longer hands out: the process aborts ("terminate called without an
        active exception", pytorch/pytorch#190489). Dropped here, it goes now, in one piece.
        """
        for pg in self.created:
            dist.destroy_process_group(pg)
        self.created.clear()
        self.tp = self.dp = self.pp = None


def build_groups(shape: ParallelShape, gpu_of_rank: Sequence[int], *, timeout: timedelta,
                 backend: str | None = None) -> ParallelGroups:
    """Create every TP, DP and PP group of the layout (collective); keep this process's."""
    me = dist.get_rank()
    role = roles(shape, gpu_of_rank)[me]
    all_members = group_members(shape, gpu_of_rank)
    mine: dict[str, Any] = {}
    member_of: dict[str, tuple[int, ...]] = {}
    created: list[Any] = []
    try:
        for kind in GROUP_KINDS:
            for ranks in all_members[kind]:
                pg = dist.new_group(list(ranks), timeout=timeout, backend=backend)
                if me in ranks:
                    mine[kind], member_of[kind] = pg, ranks
                    created.append(pg)
    except BaseException:
        for pg in created:
            dist.destroy_process_group(pg)
        raise
    return ParallelGroups(role, tuple(int(g) for g in gpu_of_rank), member_of, mine["tp"],
                          mine["dp"], mine["pp"], created)


def thread_ids() -> frozenset[int]:
    """This process's thread ids (empty where /proc cannot tell), for live_gloo_workers."""
    tasks = Path("/proc/self/task")
    return frozenset(int(t.name) for t in tasks.iterdir()) if tasks.is_dir() else frozenset()


def live_gloo_workers(besides: Collection[int] = ()) -> int:
    """gloo worker threads alive in this process, those in ``besides`` left out (0 where /proc
    cannot tell).

    Each gloo process group runs threads named ``pt_gloo_runloop`` until its C++ side is
    destroyed. A follower's groups gone with its ``close()`` leave none but the ones already
    running when it was made (``besides=thread_ids()`` then: ids, since a group just made may
    not have named its threads yet); any other is a group still referenced, to be torn down at
    interpreter shutdown, where gloo may abort (ParallelGroups.destroy). The job's default
    group is no measure: once ``torch._dynamo`` is imported torch itself keeps it referenced
    after ``destroy_process_group()``.
    """
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return 0
    n = 0
    for task in tasks.iterdir():
        if int(task.name) in besides:
            continue
        try:
            n += (task / "comm").read_text().strip() == "pt_gloo_runloop"
        except OSError:  # the thread ended while we looked
            continue
    return n
