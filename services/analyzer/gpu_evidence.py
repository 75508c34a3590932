"""GPU health (NVML, from the job's agents) attached to the incidents the analyzer writes.

Adapter over ``greyhound.core.gpu_health``: ask the agents for a fresh sample, let the core find
what explains the incident, keep the samples (bounded) as evidence and the words as the
incident's ``explanation``. Every step tolerates having nothing: no agent answering, no NVML on
the nodes, no finding; then the incident is what it would have been without GPU health.
"""

from __future__ import annotations

import time
from typing import Any

from nats.aio.client import Client as NATS
from sqlalchemy.ext.asyncio import AsyncSession

from greyhound.core.gpu_health import evidence, explain_hang, explain_slow, explanation
from services.common.bus import control
from services.common.db import repository as repo
from services.common.db.documents import Culprit, Evidence, GpuHealth
from services.common.db.models import Incident

HANG_UNDETERMINED = "hang"


async def job_gpu_health(nc: NATS, session: AsyncSession, job: str, *, timeout_s: float = 2.0
                         ) -> list[dict[str, Any]]:
    """Fresh samples of the job's GPUs from every agent that watches its ranks (read with
    ``session``)."""
    ranks = await repo.job_ranks(session, job)
    agents = sorted({r.agent_id for r in ranks})
    if not agents:
        return []
    return await control.gpu_health(nc, job, agents, timeout_s=timeout_s)


def attach_slow(incident: Incident, compute_ranks: list[int], samples: list[dict[str, Any]]
                ) -> str | None:
    """Evidence and words for a compute straggler whose GPU is throttled or clocked low."""
    if not samples:
        return None
    findings = explain_slow(samples, compute_ranks)
    words = explanation(findings)
    found = Evidence(gpu_health=GpuHealth.model_validate(evidence(samples, findings)))
    if words:
        found = found.model_copy(update={"explanation": words})
    incident.evidence = incident.evidence.merged(found)
    return words


def explain_hang_with_gpus(kind: str, culprit: Culprit, samples: list[dict[str, Any]]
                           ) -> tuple[str, Culprit, GpuHealth | None, str | None]:
    """(kind, culprit, evidence, words) of a hang given its GPUs' health. An Xid, uncorrectable
    ECC or NVLink errors explain a hang; when the counters could not name the cause, the GPU that
    reported them does: the hang is ``hang_hardware`` on that GPU's ranks."""
    if not samples:
        return kind, culprit, None, None
    findings = explain_hang(samples, culprit.ranks, now_s=time.time())
    words = explanation(findings)
    if findings and kind == HANG_UNDETERMINED:
        ranks = sorted({r for f in findings for r in f.ranks})
        kind = "hang_hardware"
        culprit = culprit.model_copy(update={"ranks": ranks[:64], "by": "gpu_health"})
    return kind, culprit, GpuHealth.model_validate(evidence(samples, findings)), words
