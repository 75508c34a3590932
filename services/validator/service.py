"""Validator: a classified slow suspicion in, a confirmed culprit (or a transient) out.

Adapter: decode the Suspicion -> ask the job's agents for status -> pause every rank at one
iteration boundary -> GEMM and P2P benchmarks on the paused job -> resume (always) -> judge with
the pure verdict core -> update the incident, commit, then announce it. The job is held only
between the pause and the resume; that span is measured and kept as evidence (``pause_s``).

The host parks at an NCCL boundary while GPU work it already enqueued keeps running (NCCL is
asynchronous), so each rank first waits for its queued GPU work to drain, then times the
benchmarks on the GPU. The wait is not part of any duration; each rank's total is kept as
evidence (``drain_s``). What it can still do is start the two ends of a transfer at different
moments: the end that starts first waits for its peer inside its timed kernel. So a transfer's
time is its best repeat (back-to-back repeats start together), as a GEMM's is.

Never harm the job. Transfers never run on the job's own communicators: NCCL runs a
communicator's operations in order, so a send whose peer never posts would hold every later
training collective behind it. Every rank of each communicator whose links are checked first
drains (all of them, or no transfer is issued), then splits a benchmark communicator from it
(all at once, in one order: a split is collective over the whole communicator), and the
transfers run there; the hook aborts one whose transfer fails. And a pause counts toward the
collective the rank parked in, which the framework timed from before the call (PyTorch's
watchdog aborts at the process group's timeout), so a validation holds the job at most
``pause_budget_s`` and never more than a quarter of the timeout the ranks report; it is refused
when that leaves less than ``min_pause_s``. A validation that cannot finish (an agent gone,
the budget spent) is abandoned: the job is resumed (the ranks of an agent that is gone, at
their lease's end) and the incident says so.

Exactly one validation per suspicion, however often it is delivered: a validator first *claims*
the suspicion (a row in ``validation_claims`` with a lease it renews while it works). A delivery
of a suspicion that is claimed and alive, or finished, does nothing, so a redelivery (the ack
wait ran out during a long validation, the validator restarted) never pauses the job again. A
claim whose lease lapsed means its validator died mid-validation: the pause it made produced no
result (and the hook releases a paused job when its lease ends), so the suspicion is validated
again, by whichever validator finds it first, up to ``max_attempts`` times in all; past that it
is recorded as abandoned on the incident. The result, the claim's end and the announcement are
one transaction (the announcement through the transactional outbox), retried while the database
is away rather than lost with the measurements. Every ``resume_every_s`` a validator also looks
for lapsed claims and for suspicions that no validator ever claimed (their bus copy was lost) and
validates them from what the database kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from greyhound.core.confirmed_culprit import name_culprit
from greyhound.core.placement import Placement
from greyhound.core.validation_plan import (
    CommView,
    PausePlan,
    Transfer,
    gemm_ranks,
    link_classes,
    members,
    pause_plan,
    reference_comms,
    suspect_comms,
    transfer_rounds,
)
from greyhound.core.verdict import (
    ValidationVerdict,
    combine_verdicts,
    judge_gemm,
    judge_links_by_class,
)
from greyhound.hookabi import PAUSE_TIMEOUT_SHARE
from services.common.bus.client import Consumer
from services.common.bus.contract import (
    BenchItem,
    BenchOutcome,
    ControlReply,
    ControlRequest,
    IncidentEvent,
    RankStatus,
    Subjects,
    Suspicion,
)
from services.common.bus.control import ControlTimeout, request
from services.common.bus.errors import describe, is_transient
from services.common.bus.streams import VALIDATOR
from services.common.db import repository as repo
from services.common.db.documents import Culprit, Evidence, Gpu, Validation
from services.common.db.models import Incident, Rank
from services.common.runtime import ServiceContext, supervise
from services.common.unit_of_work import UnitOfWork, Work
from services.validator.gpu_evidence import confirmed_gpu_health
from services.validator.guard import SuspicionRefused, refusal
from services.validator.settings import ValidatorSettings

log = logging.getLogger(__name__)

RESUME_MARGIN_S = 1.0  # the validation's own steps end this long before the hooks' lease


class ValidationFailed(RuntimeError):
    """The check could not be carried out (an agent did not answer, ranks did not park)."""


@dataclass
class Run:
    """What one validation found; ``verdict`` is None when it could not be carried out."""

    verdict: ValidationVerdict | None = None
    failure: str | None = None
    pause_s: float = 0.0
    evidence: dict[str, Any] = field(default_factory=dict)
    gpu_health: dict[str, Any] | None = None  # NVML's view of the confirmed slow GPUs
    explanation: str | None = None


RUNS_KEPT = 100  # the latest validations, for tests and inspection


def pause_budget(config: ValidatorSettings, status: Iterable[RankStatus]
                 ) -> tuple[float, float | None]:
    """How long a validation may hold the job: ``pause_budget_s``, and never more than
    PAUSE_TIMEOUT_SHARE of the shortest collective timeout a rank reported (the hooks cut a pause
    there too); with that timeout (None when no rank reported one)."""
    reported = [st.job_timeout_s for st in status if st.job_timeout_s]
    timeout = min(reported) if reported else None
    budget = config.pause_budget_s
    if timeout is not None:
        budget = min(budget, timeout / PAUSE_TIMEOUT_SHARE)
    return budget, timeout


@dataclass(frozen=True, slots=True)
class _Budget:
    """The monotonic deadline of a validation's steps."""

    end: float

    def left(self) -> float:
        return self.end - time.monotonic()


class Validator:
    def __init__(self, ctx: ServiceContext, settings: ValidatorSettings | None = None, *,
                 work: Work | None = None) -> None:
        self.ctx = ctx
        self.config = settings or ValidatorSettings()
        self.runs: deque[Run] = deque(maxlen=RUNS_KEPT)
        self.holder = f"{socket.gethostname()[:40]}-{uuid.uuid4().hex[:12]}"
        self._work = work
        self.refused = 0  # suspicions refused by the guard (no pause)
        self._jobs: dict[str, tuple[asyncio.Lock, list[int]]] = {}  # job -> (lock, [users])

    @property
    def work(self) -> Work:
        """Made when first needed: a validator used for its checks alone needs no database."""
        if self._work is None:
            self._work = self.ctx.work("validator")
        return self._work

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

    # ---- one validation per suspicion (see the module docstring) ---------------------------

    async def validate_once(self, s: Suspicion) -> None:
        """Validate ``s`` unless it is claimed by a live validator or finished. One validation
        of a job at a time in this process (the consumer and the resume loop may both bring
        one); the job's lock is forgotten when nobody uses it."""
        lock, users = self._jobs.setdefault(s.job_id, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                await self._validate_claimed(s)
        finally:
            users[0] -= 1
            if not users[0]:
                self._jobs.pop(s.job_id, None)

    async def _validate_claimed(self, s: Suspicion) -> None:
        outcome, attempt = await self._claim(s)
        if outcome == "exhausted":
            await self._abandon(s, attempt)
            return
        if outcome != "mine":
            log.info("suspicion %s of job %s: not validated again (%s)", s.event_id, s.job_id,
                     outcome)
            return
        async with self.work.read() as session:
            ranks = list(await repo.job_ranks(session, s.job_id))
        lease = asyncio.create_task(self._keep_lease(s.event_id), name=f"lease-{s.event_id}")
        try:
            run = await self.validate(s, ranks)
            run.evidence["attempt"] = attempt
            self.runs.append(run)
            if run.verdict is not None and run.verdict.gpus:
                run.gpu_health, run.explanation = await confirmed_gpu_health(
                    self.ctx.nc, s.job_id, ranks, run.verdict.gpus)
            await self._record_patiently(s, ranks, run)
        finally:
            lease.cancel()
            await asyncio.gather(lease, return_exceptions=True)

    def _lease_until(self) -> tuple[datetime, datetime]:
        now = datetime.now(UTC)
        return now, now + timedelta(seconds=self.config.claim_lease_s)

    async def _claim(self, s: Suspicion) -> repo.ClaimOutcome:
        now, until = self._lease_until()
        async with self.work.unit() as uow:
            return await repo.claim_validation(
                uow.session, suspicion_id=s.event_id, incident_id=s.incident_id,
                job_id=s.job_id, suspicion=s.model_dump_json(), holder=self.holder, now=now,
                lease_until=until, max_attempts=self.config.max_attempts)

    async def _keep_lease(self, suspicion_id: str) -> None:
        """Renew the claim while the validation runs; a renewal the database misses is retried
        at the next beat (the lease is three beats long)."""
        while True:
            await asyncio.sleep(self.config.claim_lease_s / 3)
            try:
                async with self.work.unit() as uow:
                    mine = await repo.renew_claim(uow.session, suspicion_id, self.holder,
                                                  self._lease_until()[1])
            except Exception as exc:
                log.warning("could not renew the claim on suspicion %s: %s", suspicion_id,
                            describe(exc))
                continue
            if not mine:
                log.warning("suspicion %s: the claim was taken over (this validator's lease "
                            "lapsed); its result will not be recorded", suspicion_id)
                return

    async def _abandon(self, s: Suspicion, attempts: int) -> None:
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

    async def resume_once(self) -> int:
        """Validate what a dead validator left (lapsed claims) and suspicions no validator ever
        claimed; how many were taken up."""
        now = datetime.now(UTC)
        async with self.work.read() as session:
            lapsed = [c.suspicion for c in await repo.lapsed_claims(session, now)]
            lost = [m.payload for m in await repo.unclaimed_suspicions(
                session, now - timedelta(seconds=self.config.unclaimed_after_s))]
        for raw in [*lapsed, *lost]:
            s = Suspicion.model_validate_json(raw)
            log.info("suspicion %s of job %s: validating it again (its validator stopped, or "
                     "its message was lost)", s.event_id, s.job_id)
            await self.validate_once(s)
        return len(lapsed) + len(lost)

    async def run_resume(self, stop: asyncio.Event) -> None:
        """resume_once at start-up and every resume_every_s; the database being away is
        waited out, anything else ends the service."""
        while not stop.is_set():
            try:
                await self.resume_once()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                log.warning("resuming validations failed: %s", describe(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.resume_every_s)

    # ---- the check on the job ---------------------------------------------------------------

    async def validate(self, s: Suspicion, ranks: Sequence[Rank]) -> Run:
        agents: dict[str, list[int]] = defaultdict(list)
        for r in ranks:
            agents[r.agent_id].append(r.rank)
        if not agents:
            return Run(failure="no ranks known for the job")
        try:
            status = await self._status(s.job_id, agents)
        except ValidationFailed as exc:
            return Run(failure=str(exc))
        comms = {r: [CommView(c.comm_id, c.comm_rank, c.nranks, c.last_seq_entered)
                     for c in st.comms] for r, st in status.items()}
        try:
            plan = pause_plan(comms)
        except ValueError as exc:
            return Run(failure=f"no pause point: {exc}")
        budget_s, job_timeout_s = pause_budget(self.config, status.values())
        groups = members(comms)
        gpus = gemm_ranks(s.ranks, [*s.comm_ids, *s.slow_groups], groups, comms)
        links = suspect_comms(s.kind, [*s.comm_ids, *s.slow_groups], s.ranks, groups, comms)
        node_of = {r.rank: (r.node if r.node is not None else r.host) for r in ranks}
        refs = reference_comms(links, groups, node_of) if links else []
        # suspects first: a link both groups have is checked once, and judged as a suspect's
        rounds = transfer_rounds([*links, *refs], groups)
        ref_ids = set(refs)
        reference = [t.link for rnd in rounds for t in rnd if t.comm_id in ref_ids]
        run = Run(evidence={"pause_seq": {str(c): q for c, q in sorted(plan.seq_of_comm.items())},
                            "gemm_ranks": gpus, "p2p_comms": links, "p2p_reference_comms": refs,
                            "p2p_rounds": len(rounds), "pause_budget_s": round(budget_s, 3),
                            "job_timeout_s": job_timeout_s})
        if budget_s < self.config.min_pause_s:
            run.failure = (f"refused: the job's collective timeout ({job_timeout_s:g} s) leaves "
                           f"{budget_s:.2f} s for a pause (a quarter of it), under "
                           f"{self.config.min_pause_s:g} s; the job was not paused")
            return run
        t0 = time.monotonic()
        # The pause is a lease: should this process die before its resume, the hooks resume by
        # themselves at its end; the validation's own steps end a second before it.
        clock = _Budget(t0 + budget_s - RESUME_MARGIN_S)
        drain: dict[int, float] = {}
        try:
            await self._pause(s.job_id, agents, plan, budget_s)
            run.evidence["paused_after_s"] = await self._wait_paused(s.job_id, agents, t0, clock)
            gemm = await self._gemm(s.job_id, agents, gpus, drain, clock)
            p2p = await self._p2p(s.job_id, agents, rounds, groups, drain, clock, run)
        except ValidationFailed as exc:
            run.failure = str(exc)
            return run
        finally:
            await self._resume(s.job_id, agents)
            run.pause_s = time.monotonic() - t0
            run.evidence["drain_s"] = {str(r): round(v, 6) for r, v in sorted(drain.items())}
        thr = self.config.threshold
        run.verdict = combine_verdicts(
            judge_gemm(gemm, threshold=thr) if gemm else None,
            judge_links_by_class(p2p, link_classes(p2p, node_of), reference=reference,
                                 threshold=thr) if p2p else None)
        run.evidence.update({"gemm_s": {str(k): v for k, v in gemm.items()},
                             "p2p_s": {f"{a}-{b}": v for (a, b), v in p2p.items()}})
        log.info("job %s: validation %s in %.2fs (gpus %s, links %s)", s.job_id,
                 run.verdict.kind, run.pause_s, run.verdict.gpus, run.verdict.links)
        return run

    async def _ask(self, agent: str, req: ControlRequest) -> ControlReply:
        try:
            reply = await request(self.ctx.nc, agent, req)
        except ControlTimeout as exc:
            holding = req.action != "status"
            raise ValidationFailed(
                f"abandoned: {exc}" + ("; the job was resumed (ranks whose agent is gone "
                                        "resume at their lease's end)" if holding else "")
            ) from exc
        if not reply.ok:
            raise ValidationFailed(f"agent {agent} refused {req.action}: {reply.error}")
        return reply

    async def _each(self, job: str, agents: dict[str, list[int]], **kw: Any
                    ) -> list[ControlReply]:
        """The same action to every agent for its own ranks, concurrently."""
        return list(await asyncio.gather(*(
            self._ask(a, ControlRequest(job_id=job, ranks=rs, **kw)) for a, rs in agents.items())))

    async def _status(self, job: str, agents: dict[str, list[int]]) -> dict[int, RankStatus]:
        replies = await self._each(job, agents, action="status",
                                   timeout_s=self.config.status_timeout_s)
        return {st.rank: st for reply in replies for st in reply.ranks}

    async def _pause(self, job: str, agents: dict[str, list[int]], plan: PausePlan,
                     lease_s: float) -> None:
        """One request per agent and pause sequence number (an agent's ranks may be on
        communicators with different cuts)."""
        asks = []
        for a, rs in agents.items():
            by_seq: dict[int, list[int]] = defaultdict(list)
            for r in rs:
                by_seq[plan.seq_of_rank(r)].append(r)
            asks += [self._ask(a, ControlRequest(
                job_id=job, action="pause", ranks=sorted(group), pause_seq=seq,
                pause_comm_id={r: plan.comm_of_rank[r] for r in group}, lease_s=lease_s))
                for seq, group in sorted(by_seq.items())]
        await asyncio.gather(*asks)

    async def _wait_paused(self, job: str, agents: dict[str, list[int]], t0: float,
                           clock: _Budget) -> float:
        limit = min(self.config.pause_timeout_s, clock.left())
        while True:
            status = await self._status(job, agents)
            if status and all(st.paused for st in status.values()):
                return time.monotonic() - t0
            if time.monotonic() - t0 > limit:
                held = sorted(r for r, st in status.items() if not st.paused)
                raise ValidationFailed(f"could not pause: ranks {held[:16]} did not park within "
                                       f"{limit:g}s")
            await asyncio.sleep(self.config.poll_s)

    async def _resume(self, job: str, agents: dict[str, list[int]]) -> None:
        for agent, rs in agents.items():
            try:
                await request(self.ctx.nc, agent, ControlRequest(job_id=job, action="resume",
                                                                 ranks=rs, timeout_s=5.0))
            except Exception:  # keep resuming the others; the agent logs its side
                log.exception("job %s: resume on agent %s failed", job, agent)

    async def _bench(self, job: str, agents: dict[str, list[int]], items: list[BenchItem],
                     drain: dict[int, float], clock: _Budget, *, timed: bool = True,
                     allow: frozenset[str] = frozenset()) -> list[BenchOutcome]:
        """Run ``items`` on their ranks' agents, within what is left of the budget; each rank's
        wait for its queued GPU work is added to ``drain`` (seconds), whether or not every
        benchmark got done. ``timed``: each outcome must carry durations; outcomes in a state
        of ``allow`` pass as they are."""
        left = clock.left()
        if left <= 0:
            raise ValidationFailed(f"abandoned: the pause budget ran out before the "
                                   f"{items[0].kind} step; the job was resumed")
        agent_of = {r: a for a, rs in agents.items() for r in rs}
        per: dict[str, list[BenchItem]] = defaultdict(list)
        for it in items:
            per[agent_of[it.rank]].append(it)
        timeout = min(self.config.bench_timeout_s, left)
        replies = await asyncio.gather(*(
            self._ask(a, ControlRequest(job_id=job, action="bench", ranks=sorted({i.rank for i in its}),
                                        bench=its, timeout_s=timeout))
            for a, its in per.items()))
        out = [o for reply in replies for o in reply.results]
        for o in out:
            drain[o.item.rank] = drain.get(o.item.rank, 0.0) + o.drain_ns / 1e9
        bad = [o for o in out if o.state not in allow
               and (o.state != "done" or (timed and not o.durations_ns))]
        if bad:
            what = bad[0].state if bad[0].state != "done" else "done without a timing"
            raise ValidationFailed(f"{len(bad)} benchmark(s) not done, e.g. rank {bad[0].item.rank} "
                                   f"{bad[0].item.kind}: {what}")
        return out

    async def _gemm(self, job: str, agents: dict[str, list[int]], ranks: list[int],
                    drain: dict[int, float], clock: _Budget) -> dict[int, float]:
        """Best-of-repeats GEMM time per GPU: interference only ever adds time."""
        c = self.config
        items = [BenchItem(rank=r, kind="gemm", size=c.gemm_n, repeat=c.gemm_repeat) for r in ranks]
        outs = await self._bench(job, agents, items, drain, clock) if items else []
        return {o.item.rank: min(o.durations_ns) / 1e9 for o in outs}

    async def _bench_comms(self, job: str, agents: dict[str, list[int]],
                           rounds: list[list[Transfer]], groups: dict[int, list[int]],
                           drain: dict[int, float], clock: _Budget, run: Run) -> bool:
        """Every rank of every communicator the rounds use drains (all, or no transfer is ever
        issued: a send to a peer still busy with training work would wait inside its timed
        kernel, or for good), then splits its benchmark communicator, in one order of
        communicators on every rank (a split is collective over the communicator, and two ranks
        splitting two communicators in opposite orders would wait for each other). False when
        the job's NCCL cannot give benchmark communicators of their own (the P2P checks are
        then skipped)."""
        cids = sorted({t.comm_id for rnd in rounds for t in rnd})
        who = sorted({r for c in cids for r in groups[c]})
        await self._bench(job, agents, [BenchItem(rank=r, kind="drain", repeat=1) for r in who],
                          drain, clock, timed=False)
        items = [BenchItem(rank=r, kind="split", comm_id=c, repeat=1) for c in cids
                 for r in groups[c]]
        outs = await self._bench(job, agents, items, drain, clock, timed=False,
                                 allow=frozenset({"unsupported"}))
        if any(o.state == "unsupported" for o in outs):
            run.evidence["p2p_skipped"] = (
                "the job's NCCL shares split resources (NCCL_COMM_SPLIT_SHARE_RESOURCES): a "
                "benchmark communicator would share its communicators' queue")
            return False
        return True

    async def _p2p(self, job: str, agents: dict[str, list[int]], rounds: list[list[Transfer]],
                   groups: dict[int, list[int]], drain: dict[int, float], clock: _Budget,
                   run: Run) -> dict[tuple[int, int], list[float]]:
        """Each link's time per size: a transfer lasts until both ends end (the longer of the
        two GPU times of one repeat), and the best repeat counts, since the first may hold one
        end's wait for the other (interference, like a late peer, only ever adds time)."""
        c = self.config
        times: dict[tuple[int, int], list[float]] = {}
        if not rounds or not await self._bench_comms(job, agents, rounds, groups, drain, clock, run):
            return times
        for transfers in rounds:
            items: list[BenchItem] = []
            for t in transfers:
                for size in c.p2p_bytes:
                    items.append(BenchItem(rank=t.src, kind="send", size=size, repeat=c.p2p_repeat,
                                           comm_id=t.comm_id, peer=t.dst_comm_rank))
                    items.append(BenchItem(rank=t.dst, kind="recv", size=size, repeat=c.p2p_repeat,
                                           comm_id=t.comm_id, peer=t.src_comm_rank))
            outs = await self._bench(job, agents, items, drain, clock)
            for t in transfers:
                seq: list[float] = []
                for size in c.p2p_bytes:
                    send = next(o for o in outs if o.item.rank == t.src and o.item.kind == "send"
                                and o.item.size == size and o.item.peer == t.dst_comm_rank)
                    recv = next(o for o in outs if o.item.rank == t.dst and o.item.kind == "recv"
                                and o.item.size == size and o.item.peer == t.src_comm_rank)
                    seq.append(min(max(a, b) for a, b in zip(send.durations_ns,
                                                             recv.durations_ns, strict=True)) / 1e9)
                times[t.link] = seq
        return times

    # ---- the incident -----------------------------------------------------------------------

    async def _record_patiently(self, s: Suspicion, ranks: Sequence[Rank], run: Run) -> None:
        """Record the result with its announcements, retrying while the database is away (the
        measurements exist only here; the lease is renewed meanwhile)."""
        deadline = time.monotonic() + self.config.record_patience_s
        delay = 0.5
        while True:
            try:
                async with self.work.unit() as uow:
                    announce = await self._record(uow.session, s, ranks, run)
                    if not await repo.finish_claim_held(uow.session, s.event_id, self.holder,
                                                        datetime.now(UTC)):
                        uow.discard()
                        log.warning("suspicion %s: claim no longer held; result dropped",
                                    s.event_id)
                        return
                    for e in announce:
                        await uow.stage(Subjects.incident(s.job_id), e)
                return
            except Exception as exc:
                if not is_transient(exc) or time.monotonic() + delay > deadline:
                    raise
                log.warning("recording the validation of %s failed, retrying in %.1fs: %s",
                            s.event_id, delay, describe(exc))
                await asyncio.sleep(delay)
                delay = min(2 * delay, 10.0)

    async def _record(self, session: AsyncSession, s: Suspicion, ranks: Sequence[Rank],
                      run: Run) -> list[IncidentEvent]:
        """The result on the incident (in the caller's transaction); what to announce."""
        incident = await repo.get_incident_for_update(session, s.incident_id)
        if incident is None:
            log.warning("suspicion %s names unknown incident %s", s.event_id, s.incident_id)
            return []
        facts = _jsonable({"suspicion": s.event_id, "suspected": s.kind,
                           "pause_s": round(run.pause_s, 4), **run.evidence,
                           # the ranks whose benchmark times are host times (no marks)
                           "marks_off_ranks": sorted(r.rank for r in ranks if r.marks_off)})
        if run.verdict is None:
            failed = Validation.model_validate({**facts, "outcome": run.failure})
            incident.evidence = incident.evidence.merged(Evidence(validation=failed))
            log.warning("job %s: validation not done: %s", s.job_id, run.failure)
            return []
        v = run.verdict
        facts.update(_jsonable({"verdict": v.kind, "gpus": v.gpus,
                                "links": [list(x) for x in v.links], **v.evidence}))
        if run.gpu_health is not None:
            facts["gpu_health"] = _jsonable(run.gpu_health)
        detail = Validation.model_validate(facts)
        found = Evidence(validation=detail)
        if run.explanation:
            found = found.model_copy(update={"explanation": run.explanation})
        incident.evidence = incident.evidence.merged(found)
        if await repo.add_timeline(session, incident, "validated", detail) == "resolved":
            log.info("incident %s recovered while it was validated: it stays resolved",
                     incident.id)
        if v.kind == "transient":
            # The checks found nothing slow: the fail-slow may have ended, or its cause is one
            # GEMM and P2P checks cannot reproduce (host-side contention). Only the tracker's
            # recovery resolves an incident, so the analyzer's localisation stands meanwhile.
            log.info("job %s: checks did not reproduce the slowdown", s.job_id)
        else:
            incident.kind = v.kind
            incident.culprit = incident.culprit.merged(culprit(v, ranks))
        return [IncidentEvent(job_id=s.job_id, incident_id=incident.id, stage="validated",
                              kind=incident.kind, severity=incident.severity,
                              summary=incident.summary)]


def culprit(v: ValidationVerdict, ranks: Sequence[Rank]) -> Culprit:
    """What the verdict confirmed, named where the job's ranks ran
    (greyhound.core.confirmed_culprit)."""
    n = name_culprit(v.gpus, v.links, placements(ranks))
    return Culprit(gpus=[Gpu(rank=g.rank, node=g.node, host=g.host, device=g.device)
                         for g in n.gpus],
                   links=n.links, link_ranks=n.link_ranks, slow_ranks=n.slow_ranks,
                   ranks=n.ranks, nodes=n.nodes)


def placements(ranks: Sequence[Rank]) -> dict[int, Placement]:
    return {r.rank: Placement(r.host, r.device, r.node) for r in ranks}


def _jsonable(value: Any) -> Any:
    """JSONB has no NaN or infinity: those become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


async def run_validator(ctx: ServiceContext, stop: asyncio.Event,
                        settings: ValidatorSettings | None = None, *,
                        validator: Validator | None = None) -> None:
    """The service: its settings from the environment unless given; ends when ``stop`` is set,
    or raises when its consumer, its outbox relay or its resume loop cannot go on (the process
    exits for its supervisor)."""
    validator = validator or Validator(ctx, settings)
    consumer: Consumer[Suspicion] = Consumer(ctx.js, VALIDATOR, Suspicion, validator.consume)

    async def stopper() -> None:
        await stop.wait()
        consumer.stop()

    await supervise(consumer.run(), stopper(), validator.work.relay(stop),
                    validator.run_resume(stop))
