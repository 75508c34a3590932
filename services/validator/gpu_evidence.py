"""GPU health next to the validator's verdict: a GPU the GEMM check confirmed slow, and what its
own NVML counters say (throttled, clocked low). The check proves the GPU slow; NVML says why."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nats.aio.client import Client as NATS

from greyhound.core.gpu_health import evidence, explain_slow, explanation
from services.common.bus import control
from services.common.db.models import Rank


async def confirmed_gpu_health(nc: NATS, job: str, ranks: Sequence[Rank], gpus: Sequence[int], *,
                               timeout_s: float = 2.0) -> tuple[dict[str, Any] | None, str | None]:
    """(evidence, words) for the confirmed slow ``gpus`` (ranks); (None, None) when there are
    none or no agent could sample them."""
    if not gpus:
        return None, None
    agents = sorted({r.agent_id for r in ranks})
    samples = await control.gpu_health(nc, job, agents, timeout_s=timeout_s) if agents else []
    if not samples:
        return None, None
    findings = explain_slow(samples, list(gpus))
    return evidence(samples, findings), explanation(findings)
