"""Exactly one validation per suspicion, however often it is delivered: a validator first
*claims* the suspicion (a row in ``validation_claims`` with a lease it renews while it works).
A delivery of a suspicion that is claimed and alive, or finished, does nothing, so a redelivery
(the ack wait ran out during a long validation, the validator restarted) never pauses the job
again. A claim whose lease lapsed means its validator died mid-validation: the pause it made
produced no result (and the hook releases a paused job when its lease ends), so the suspicion is
validated again, by whichever validator finds it first, up to ``max_attempts`` times in all;
past that it is recorded as abandoned on the incident. What a dead validator left, and
suspicions no validator ever claimed (their bus copy was lost), are found here too.

One validation per *job* at a time, across every validator: before it pauses a job, a validator
takes the job (a row per job, services.common.db.exclusion: a claim with a lease, not an
advisory lock, as argued there), waits while another validation holds it, renews it with the
suspicion's claim and gives it back as soon as the job is resumed. So a second live validator
can never pause a job the first holds, nor can the first's resume end the second's pause.

The job's lease is the suspicion claim's (``claim_lease_s``), renewed on the same beat: a
holder that died frees its job when its suspicion is taken over, so the validation a restarted
validator takes up runs at once, while the fault is still there. A pause the dead holder left
in force is no obstacle: the new validation's pause renews the hooks' lease and its resume ends
it (the dead one never resumes). A lease long enough to outlast that pause (pause budget plus
a beat) made the restarted validation wait some 25 s more, past the end of the resilience test's
fault. What it leaves: a holder stalled past its lease (alive, its claims taken) may still send
its resume during the next validation; that validation's benchmarks then end FAILED with the
pause (a validation without a verdict), never harm to the job.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncSession

from services.common.bus.contract import Suspicion
from services.common.bus.errors import TransientError, describe
from services.common.db import exclusion
from services.common.db import repository as repo
from services.common.db.documents import Evidence, Validation
from services.common.unit_of_work import Work
from services.validator.settings import ValidatorSettings

log = logging.getLogger(__name__)

JOB_POLL_S = 0.5  # how often a validation waiting for its job asks again


class Claims:
    """This validator's claims (``holder`` names it), each in a unit of work of its own."""

    def __init__(self, work: Work, config: ValidatorSettings, holder: str) -> None:
        self.work = work
        self.config = config
        self.holder = holder

    def lease_until(self) -> tuple[datetime, datetime]:
        now = datetime.now(UTC)
        return now, now + timedelta(seconds=self.config.claim_lease_s)

    async def claim(self, s: Suspicion) -> repo.ClaimOutcome:
        now, until = self.lease_until()
        async with self.work.unit() as uow:
            return await repo.claim_validation(
                uow.session, suspicion_id=s.event_id, incident_id=s.incident_id,
                job_id=s.job_id, suspicion=s.model_dump_json(), holder=self.holder, now=now,
                lease_until=until, max_attempts=self.config.max_attempts)

    @property
    def job_lease_s(self) -> float:
        """How long a job stays taken unless renewed: the suspicion claim's lease, renewed with
        it (see the module docstring)."""
        return self.config.claim_lease_s

    async def take_job(self, s: Suspicion) -> bool:
        """Take ``s``'s job for its validation; False while another validation holds it."""
        async with self.work.unit() as uow:
            return await exclusion.take_job_validation(
                uow.session, job_id=s.job_id, holder=self.holder, suspicion_id=s.event_id,
                lease_s=self.job_lease_s)

    async def wait_for_job(self, s: Suspicion) -> None:
        """Take ``s``'s job, waiting while other validations hold it; after twice the job's
        lease (a dead holder's would have lapsed: others kept taking it first) a
        TransientError, so the suspicion comes again later."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + 2 * self.job_lease_s
        while not await self.take_job(s):
            if loop.time() > give_up:
                raise TransientError(f"job {s.job_id} stayed under other validations for "
                                     f"{2 * self.job_lease_s:g} s")
            await asyncio.sleep(JOB_POLL_S)

    async def release_job(self, s: Suspicion) -> None:
        """Give ``s``'s job back (it is resumed); a release the database misses leaves the
        claim to lapse."""
        try:
            async with self.work.unit() as uow:
                await exclusion.release_job_validation(
                    uow.session, job_id=s.job_id, holder=self.holder, suspicion_id=s.event_id)
        except Exception as exc:
            log.warning("could not give job %s back (its claim lapses within %g s): %s",
                        s.job_id, self.job_lease_s, describe(exc))

    async def keep_lease(self, s: Suspicion) -> None:
        """Renew the claim on ``s`` and on its job while the validation runs; a renewal the
        database misses is retried at the next beat (a lease is three beats long or more)."""
        suspicion_id = s.event_id
        while True:
            await asyncio.sleep(self.config.claim_lease_s / 3)
            try:
                async with self.work.unit() as uow:
                    mine = await repo.renew_claim(uow.session, suspicion_id, self.holder,
                                                  self.lease_until()[1])
                    await exclusion.renew_job_validation(
                        uow.session, job_id=s.job_id, holder=self.holder,
                        suspicion_id=suspicion_id, lease_s=self.job_lease_s)
            except Exception as exc:
                log.warning("could not renew the claim on suspicion %s: %s", suspicion_id,
                            describe(exc))
                continue
            if not mine:
                log.warning("suspicion %s: the claim was taken over (this validator's lease "
                            "lapsed); its result will not be recorded", suspicion_id)
                return

    async def abandon(self, s: Suspicion, attempts: int) -> None:
        """Out of tries: say so on the incident; the job is not paused again."""
        async with self.work.unit() as uow:
            incident = await repo.get_incident_for_update(uow.session, s.incident_id)
            if incident is not None:
                incident.evidence = incident.evidence.merged(Evidence(validation=Validation(
                    suspicion=s.event_id, outcome=f"abandoned: {attempts} attempt(s) "
                    "interrupted (the validator stopped mid-validation)", attempt=attempts)))
            await repo.finish_claim(uow.session, s.event_id, "abandoned", datetime.now(UTC))
        log.warning("suspicion %s of job %s abandoned after %d interrupted attempt(s)",
                    s.event_id, s.job_id, attempts)

    async def finished(self, session: AsyncSession, s: Suspicion) -> bool:
        """Mark the claim on ``s`` done in the caller's unit, which records its result; False
        when another validator took it over (its result is the one to record)."""
        return await repo.finish_claim_held(session, s.event_id, self.holder, datetime.now(UTC))

    async def left_over(self) -> list[Suspicion]:
        """What a dead validator left (lapsed claims) and suspicions no validator ever claimed
        (published ``unclaimed_after_s`` ago)."""
        now = datetime.now(UTC)
        async with self.work.read() as session:
            lapsed = [c.suspicion for c in await repo.lapsed_claims(session, now)]
            lost = [m.payload for m in await repo.unclaimed_suspicions(
                session, now - timedelta(seconds=self.config.unclaimed_after_s))]
        return [Suspicion.model_validate_json(raw) for raw in [*lapsed, *lost]]
