"""Request/reply to node agents over core NATS: control is a conversation, not a stream.

A request that no agent answers in time raises ``ControlTimeout``; callers decide whether the
validation can go on without that agent's ranks.

Requests that hold the job (pause, bench, resume) go on the validation subject, the others on the
control subject: the server's permissions let only the validator publish on the first, and an
agent refuses a holding request that comes on the second.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from services.common.bus.contract import ControlReply, ControlRequest, Subjects

log = logging.getLogger(__name__)

HOLDING_ACTIONS = frozenset({"pause", "bench", "resume"})


class ControlTimeout(RuntimeError):
    """An agent did not answer a control request."""


def subject_for(job: str, agent: str, action: str) -> str:
    """The subject a request of ``action`` travels on."""
    if action in HOLDING_ACTIONS:
        return Subjects.validation(job, agent)
    return Subjects.control(job, agent)


async def request(nc: NATS, agent: str, req: ControlRequest) -> ControlReply:
    subject = subject_for(req.job_id, agent, req.action)
    try:
        msg = await nc.request(subject, req.model_dump_json().encode(), timeout=req.timeout_s + 2.0)
    except (NatsTimeoutError, TimeoutError, NoRespondersError) as exc:
        raise ControlTimeout(f"agent {agent} did not answer {req.action} for job "
                             f"{req.job_id}: {type(exc).__name__}") from exc
    return ControlReply.model_validate_json(msg.data)


async def request_all(nc: NATS, agents: list[str], req: ControlRequest) -> list[ControlReply]:
    """The same request to several agents at once (each gets only its ranks' part of it)."""
    return list(await asyncio.gather(*(request(nc, a, req) for a in agents)))


async def gpu_health(nc: NATS, job: str, agents: list[str], *, timeout_s: float = 2.0
                     ) -> list[dict[str, Any]]:
    """A fresh GPU health sample (the ``gpu`` action) from each of ``agents`` for ``job``, as
    plain dicts; an agent that does not answer, refuses or has no NVML adds nothing. GPU health
    explains an incident; its absence must never hold one up."""
    req = ControlRequest(job_id=job, action="gpu", timeout_s=timeout_s)
    replies = await asyncio.gather(*(request(nc, a, req) for a in agents), return_exceptions=True)
    out: list[dict[str, Any]] = []
    for agent, reply in zip(agents, replies, strict=True):
        if isinstance(reply, BaseException):
            log.info("no GPU health from agent %s for job %s: %s", agent, job, reply)
        elif reply.ok:
            out.extend(g.model_dump(mode="json") for g in reply.gpus)
    return out
