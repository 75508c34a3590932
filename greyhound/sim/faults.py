"""Faults in virtual time: what is slow at a given moment, and which hang strikes when.

Faults name hardware, not roles: ``rank`` is the GPU that initially hosts that rank (so a
mitigation that moves the rank away from a throttled GPU leaves the GPU throttled), ``node`` a
machine, ``nodes`` a node pair's network link.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from greyhound.core.arrays import FloatArray
from greyhound.sim.scenario import HANG_KINDS, FaultSpec, JobSpec


@dataclass(frozen=True, slots=True)
class Slowness:
    """Multipliers in force at one moment: per GPU compute, per node host work, per link."""

    gpu: FloatArray
    cpu: FloatArray
    links: tuple[tuple[int, int, float], ...]


def active_set(faults: Sequence[FaultSpec], t: float, cleared: Collection[int]) -> tuple[int, ...]:
    """Indices of the slow-kind faults in force at ``t`` (the cache key of derived timings)."""
    return tuple(
        i
        for i, f in enumerate(faults)
        if f.kind not in HANG_KINDS and i not in cleared and f.active(t)
    )


def slowness(job: JobSpec, faults: Sequence[FaultSpec], active: Sequence[int]) -> Slowness:
    gpu = np.ones(job.world)
    cpu = np.ones(job.nodes)
    links: dict[tuple[int, int], float] = {}
    for i in active:
        f = faults[i]
        if f.kind == "gpu_slow" and f.rank is not None:
            gpu[f.rank] *= f.factor
        elif f.kind == "cpu_contention" and f.node is not None:
            cpu[f.node] *= f.factor
        elif f.kind == "link_congestion" and f.nodes is not None:
            links[f.nodes] = links.get(f.nodes, 1.0) * f.factor
    return Slowness(gpu, cpu, tuple((a, b, c) for (a, b), c in sorted(links.items())))


def pending_hang(
    faults: Sequence[FaultSpec], t0: float, t1: float, cleared: Collection[int]
) -> int | None:
    """The hang fault that strikes before ``t1`` and is still in force after ``t0``, if any."""
    for i, f in enumerate(faults):
        if f.kind in HANG_KINDS and i not in cleared and f.start_s < t1 and f.end_s > t0:
            return i
    return None
