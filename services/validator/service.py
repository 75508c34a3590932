"""Validator: a classified slow suspicion in, a confirmed culprit (or a transient) out.

A small orchestrator over three collaborators: the guard (services.validator.guard: only a
suspicion an open, localised incident of its job stands behind may pause the job), the claims
(services.validator.claims: one validation per suspicion, however often it is delivered, taken
over when its validator died; one validation per job at a time, whichever validator runs it)
and the hold on the job (services.validator.hold: pause at one
iteration boundary, GEMM and P2P benchmarks on the GPUs, resume always, judge with the pure
verdict core). The result is recorded on the incident (services.validator.record) with the
claim's end and its announcement in one unit of work (the announcement through the
transactional outbox), retried while the database is away rather than lost with the
measurements. Every ``resume_every_s`` a validator also takes up what a dead one left and
suspicions no validator ever claimed, from what the database kept.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from collections import deque
from collections.abc import Sequence
from functools import partial

from services.common.bus.client import Consumer
from services.common.bus.contract import Subjects, Suspicion
from services.common.bus.streams import VALIDATOR
from services.common.db import repository as repo
from services.common.db.models import Incident, Rank
from services.common.patience import patiently, periodically
from services.common.runtime import ServiceContext, supervise
from services.common.unit_of_work import UnitOfWork
from services.validator.claims import Claims
from services.validator.gpu_evidence import confirmed_gpu_health
from services.validator.guard import SuspicionRefused, refusal
from services.validator.hold import Hold, Run
from services.validator.record import record
from services.validator.settings import ValidatorSettings

log = logging.getLogger(__name__)

RUNS_KEPT = 100  # the latest validations, for tests and inspection


class Validator:
    """The validator's handler and its resume loop over the guard, the claims and the hold."""

    def __init__(self, ctx: ServiceContext, settings: ValidatorSettings) -> None:
        self.ctx = ctx
        self.config = settings
        self.work = ctx.work("validator")
        self.claims = Claims(self.work, settings,
                             f"{socket.gethostname()[:40]}-{uuid.uuid4().hex[:12]}")
        self.hold = Hold(ctx.nc, settings)
        self.runs: deque[Run] = deque(maxlen=RUNS_KEPT)
        self.refused = 0  # suspicions refused by the guard (no pause)

    @property
    def holder(self) -> str:
        return self.claims.holder

    async def consume(self, subject: str, s: Suspicion) -> None:
        """What the consumer calls: ``handle`` in a unit of work of its own."""
        await self.work.per_message(self.handle)(subject, s)

    async def handle(self, uow: UnitOfWork, subject: str, s: Suspicion) -> None:
        """Check the suspicion against its incident, then (once that read is over) validate it.
        A database or bus failure propagates: the consumer tells a transient one (retried
        later) from a permanent one (dead-lettered) with bus.errors.classify."""
        ranks = list(await repo.job_ranks(uow.session, s.job_id))
        incident = await repo.get_incident(uow.session, s.incident_id)
        self._check(s, incident, ranks)
        uow.after_commit(partial(self.validate_once, s))

    def _check(self, s: Suspicion, incident: Incident | None, ranks: Sequence[Rank]) -> None:
        """Refuse (dead-letter, before any agent is asked anything) a suspicion no open,
        localised incident of the job stands behind: see validator.guard."""
        why = refusal(s, incident, {r.rank for r in ranks})
        if why is not None:
            self.refused += 1
            log.warning("suspicion %s for job %s refused: %s", s.event_id, s.job_id, why)
            raise SuspicionRefused(why)

    async def validate_once(self, s: Suspicion) -> None:
        """Validate ``s`` unless it is claimed by a live validator or finished. One validation
        of a job at a time across every validator: the job is taken first (waiting while
        another validation holds it) and given back once resumed (services.validator.claims)."""
        await self.claims.wait_for_job(s)
        try:
            await self._validate_claimed(s)
        finally:
            await self.claims.release_job(s)

    async def _validate_claimed(self, s: Suspicion) -> None:
        outcome, attempt = await self.claims.claim(s)
        if outcome == "exhausted":
            await self.claims.abandon(s, attempt)
            return
        if outcome != "mine":
            log.info("suspicion %s of job %s: not validated again (%s)", s.event_id, s.job_id,
                     outcome)
            return
        async with self.work.read() as session:
            ranks = list(await repo.job_ranks(session, s.job_id))
        lease = asyncio.create_task(self.claims.keep_lease(s), name=f"lease-{s.event_id}")
        try:
            run = await self.hold.validate(s, ranks)
            await self.claims.release_job(s)  # resumed: another validation may pause it now
            run.evidence["attempt"] = attempt
            self.runs.append(run)
            if run.verdict is not None and run.verdict.gpus:
                run.gpu_health, run.explanation = await confirmed_gpu_health(
                    self.ctx.nc, s.job_id, ranks, run.verdict.gpus)
            await patiently(self.work, partial(self._record, s, ranks, run),
                            patience_s=self.config.record_patience_s,
                            what=f"recording the validation of {s.event_id}")
        finally:
            lease.cancel()
            await asyncio.gather(lease, return_exceptions=True)

    async def _record(self, s: Suspicion, ranks: Sequence[Rank], run: Run,
                      uow: UnitOfWork) -> None:
        """The result, the claim's end and the announcement, in one unit (dropped when another
        validator took the claim over: its result is the one to record)."""
        announce = await record(uow.session, s, ranks, run)
        if not await self.claims.finished(uow.session, s):
            uow.discard()
            log.warning("suspicion %s: claim no longer held; result dropped", s.event_id)
            return
        for e in announce:
            await uow.stage(Subjects.incident(s.job_id), e)

    async def resume_once(self) -> int:
        """Validate what a dead validator left (lapsed claims) and suspicions no validator ever
        claimed; how many were taken up."""
        found = await self.claims.left_over()
        for s in found:
            log.info("suspicion %s of job %s: validating it again (its validator stopped, or "
                     "its message was lost)", s.event_id, s.job_id)
            await self.validate_once(s)
        return len(found)

    async def run_resume(self, stop: asyncio.Event) -> None:
        """resume_once at start-up and every resume_every_s (services.common.patience)."""
        await periodically(self.resume_once, self.config.resume_every_s, stop,
                           what="resuming validations")


async def run_validator(ctx: ServiceContext, stop: asyncio.Event,
                        settings: ValidatorSettings | None = None, *,
                        validator: Validator | None = None) -> None:
    """The service: its settings from the environment unless given; ends when ``stop`` is set,
    or raises when its consumer, its outbox relay or its resume loop cannot go on (the process
    exits for its supervisor)."""
    validator = validator or Validator(ctx, settings or ValidatorSettings())
    consumer: Consumer[Suspicion] = Consumer(ctx.js, VALIDATOR, Suspicion, validator.consume,
                                             ready=validator.work.writable)

    async def stopper() -> None:
        await stop.wait()
        consumer.stop()

    await supervise(consumer.run(), stopper(), validator.work.relay(stop),
                    validator.run_resume(stop))
