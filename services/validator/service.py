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
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from greyhound.core.verdict import (
    ValidationVerdict,
    combine_verdicts,
    judge_gemm,
    judge_links_by_class,
)
from services.common.bus.client import Consumer, publish
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
from services.common.bus.streams import VALIDATOR
from services.common.db import repository as repo
from services.common.db.models import Rank
from services.common.runtime import ServiceContext, supervise
from services.validator.gpu_evidence import confirmed_gpu_health
from services.validator.plan import (
    CommView,
    Transfer,
    gemm_ranks,
    link_classes,
    members,
    pause_plan,
    reference_comms,
    suspect_comms,
    transfer_rounds,
)
from services.validator.settings import ValidatorSettings

log = logging.getLogger(__name__)


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


class Validator:
    def __init__(self, ctx: ServiceContext, settings: ValidatorSettings | None = None) -> None:
        self.ctx = ctx
        self.config = settings or ValidatorSettings()
        self.runs: list[Run] = []

    async def handle(self, subject: str, s: Suspicion) -> None:
        """A database or bus failure propagates: the consumer tells a transient one (retried
        later) from a permanent one (dead-lettered) with bus.errors.classify."""
        if await self._handled_before(s.event_id):
            return
        async with self.ctx.db()() as session:
            ranks = list(await repo.job_ranks(session, s.job_id))
        run = await self.validate(s, ranks)
        self.runs.append(run)
        if run.verdict is not None and run.verdict.gpus:
            run.gpu_health, run.explanation = await confirmed_gpu_health(
                self.ctx.nc, s.job_id, ranks, run.verdict.gpus)
        announce = await self._record(s, ranks, run)
        if announce is not None:
            await publish(self.ctx.js, Subjects.incident(s.job_id), announce)

    async def _handled_before(self, event_id: str) -> bool:
        """A redelivered suspicion must not pause the job again; claim and roll back to ask."""
        async with self.ctx.db()() as session:
            fresh = await repo.claim_event(session, VALIDATOR.durable, event_id)
            await session.rollback()
        return not fresh

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
        groups = members(comms)
        gpus = gemm_ranks(s.ranks, [*s.comm_ids, *s.slow_groups], groups, comms)
        links = suspect_comms(s.kind, [*s.comm_ids, *s.slow_groups], s.ranks, groups, comms)
        node_of = {r.rank: (r.node if r.node is not None else r.host) for r in ranks}
        refs = reference_comms(links, groups, node_of) if links else []
        # suspects first: a link both groups have is checked once, and judged as a suspect's
        rounds = transfer_rounds([*links, *refs], groups)
        ref_ids = set(refs)
        reference = [t.link for rnd in rounds for t in rnd if t.comm_id in ref_ids]
        run = Run(evidence={"pause_seq": plan.seq, "gemm_ranks": gpus, "p2p_comms": links,
                            "p2p_reference_comms": refs, "p2p_rounds": len(rounds)})
        t0 = time.monotonic()
        drain: dict[int, float] = {}
        try:
            await self._pause(s.job_id, agents, plan.comm_of_rank, plan.seq)
            run.evidence["paused_after_s"] = await self._wait_paused(s.job_id, agents, t0)
            gemm = await self._gemm(s.job_id, agents, gpus, drain)
            p2p = await self._p2p(s.job_id, agents, rounds, drain)
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
            raise ValidationFailed(str(exc)) from exc
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

    async def _pause(self, job: str, agents: dict[str, list[int]], comm_of_rank: dict[int, int],
                     seq: int) -> None:
        await asyncio.gather(*(
            self._ask(a, ControlRequest(job_id=job, action="pause", ranks=rs, pause_seq=seq,
                                        pause_comm_id={r: comm_of_rank[r] for r in rs}))
            for a, rs in agents.items()))

    async def _wait_paused(self, job: str, agents: dict[str, list[int]], t0: float) -> float:
        while True:
            status = await self._status(job, agents)
            if status and all(st.paused for st in status.values()):
                return time.monotonic() - t0
            if time.monotonic() - t0 > self.config.pause_timeout_s:
                held = sorted(r for r, st in status.items() if not st.paused)
                raise ValidationFailed(f"could not pause: ranks {held[:16]} did not park within "
                                       f"{self.config.pause_timeout_s:g}s")
            await asyncio.sleep(self.config.poll_s)

    async def _resume(self, job: str, agents: dict[str, list[int]]) -> None:
        for agent, rs in agents.items():
            try:
                await request(self.ctx.nc, agent, ControlRequest(job_id=job, action="resume",
                                                                 ranks=rs, timeout_s=5.0))
            except Exception:  # keep resuming the others; the agent logs its side
                log.exception("job %s: resume on agent %s failed", job, agent)

    async def _bench(self, job: str, agents: dict[str, list[int]], items: list[BenchItem],
                     drain: dict[int, float]) -> list[BenchOutcome]:
        """Run ``items`` on their ranks' agents; each rank's wait for its queued GPU work is
        added to ``drain`` (seconds), whether or not every benchmark got done."""
        agent_of = {r: a for a, rs in agents.items() for r in rs}
        per: dict[str, list[BenchItem]] = defaultdict(list)
        for it in items:
            per[agent_of[it.rank]].append(it)
        replies = await asyncio.gather(*(
            self._ask(a, ControlRequest(job_id=job, action="bench", ranks=sorted({i.rank for i in its}),
                                        bench=its, timeout_s=self.config.bench_timeout_s))
            for a, its in per.items()))
        out = [o for reply in replies for o in reply.results]
        for o in out:
            drain[o.item.rank] = drain.get(o.item.rank, 0.0) + o.drain_ns / 1e9
        bad = [o for o in out if o.state != "done" or not o.durations_ns]
        if bad:
            what = bad[0].state if bad[0].state != "done" else "done without a timing"
            raise ValidationFailed(f"{len(bad)} benchmark(s) not done, e.g. rank {bad[0].item.rank} "
                                   f"{bad[0].item.kind}: {what}")
        return out

    async def _gemm(self, job: str, agents: dict[str, list[int]], ranks: list[int],
                    drain: dict[int, float]) -> dict[int, float]:
        """Best-of-repeats GEMM time per GPU: interference only ever adds time."""
        c = self.config
        items = [BenchItem(rank=r, kind="gemm", size=c.gemm_n, repeat=c.gemm_repeat) for r in ranks]
        outs = await self._bench(job, agents, items, drain) if items else []
        return {o.item.rank: min(o.durations_ns) / 1e9 for o in outs}

    async def _p2p(self, job: str, agents: dict[str, list[int]], rounds: list[list[Transfer]],
                   drain: dict[int, float]) -> dict[tuple[int, int], list[float]]:
        """Each link's time per size: a transfer lasts until both ends end (the longer of the
        two GPU times of one repeat), and the best repeat counts, since the first may hold one
        end's wait for the other (interference, like a late peer, only ever adds time)."""
        c = self.config
        times: dict[tuple[int, int], list[float]] = {}
        for transfers in rounds:
            items: list[BenchItem] = []
            for t in transfers:
                for size in c.p2p_bytes:
                    items.append(BenchItem(rank=t.src, kind="send", size=size, repeat=c.p2p_repeat,
                                           comm_id=t.comm_id, peer=t.dst_comm_rank))
                    items.append(BenchItem(rank=t.dst, kind="recv", size=size, repeat=c.p2p_repeat,
                                           comm_id=t.comm_id, peer=t.src_comm_rank))
            outs = await self._bench(job, agents, items, drain)
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

    async def _record(self, s: Suspicion, ranks: Sequence[Rank], run: Run) -> IncidentEvent | None:
        async with self.ctx.db()() as session:
            if not await repo.claim_event(session, VALIDATOR.durable, s.event_id):
                return None
            incident = await repo.get_incident_for_update(session, s.incident_id)
            if incident is None:
                log.warning("suspicion %s names unknown incident %s", s.event_id, s.incident_id)
                await session.commit()
                return None
            detail = _jsonable({"suspicion": s.event_id, "suspected": s.kind,
                                "pause_s": round(run.pause_s, 4), **run.evidence})
            if run.verdict is None:
                incident.evidence = {**incident.evidence,
                                     "validation": {**detail, "outcome": run.failure}}
                await session.commit()
                log.warning("job %s: validation not done: %s", s.job_id, run.failure)
                return None
            v = run.verdict
            detail.update(_jsonable({"verdict": v.kind, "gpus": v.gpus,
                                     "links": [list(x) for x in v.links], **v.evidence}))
            if run.gpu_health is not None:
                detail["gpu_health"] = _jsonable(run.gpu_health)
            incident.evidence = {**incident.evidence, "validation": detail,
                                 **({"explanation": run.explanation} if run.explanation else {})}
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
                incident.culprit = {**incident.culprit, **culprit(v, ranks)}
            await session.commit()
            return IncidentEvent(job_id=s.job_id, incident_id=incident.id, stage="validated",
                                 kind=incident.kind, severity=incident.severity,
                                 summary=incident.summary)


def culprit(v: ValidationVerdict, ranks: Sequence[Rank]) -> dict[str, Any]:
    """The confirmed GPUs (with node, host, local device) and links (as node pairs).

    ``ranks`` names the slow GPUs' ranks; a link's end ranks are in ``link_ranks`` and join
    ``ranks`` only when no GPU is slow, so a mixed incident does not blame every rank that
    shares the congested link. ``slow_ranks`` holds both."""
    info = {r.rank: r for r in ranks}

    def node(rank: int) -> int | str:
        r = info.get(rank)
        if r is None:
            return f"rank{rank}"
        return r.node if r.node is not None else r.host

    gpus = [{"rank": g, "node": node(g), "host": info[g].host if g in info else None,
             "device": info[g].device if g in info else None} for g in v.gpus]
    links: list[list[int | str]] = []  # node pairs, each once (many rank pairs share one)
    for a, b in v.links:
        pair = sorted((node(a), node(b)), key=_node_order)
        if pair not in links:
            links.append(pair)
    slow = sorted({*v.gpus, *(r for link in v.links for r in link)})
    nodes = sorted({node(r) for r in slow}, key=_node_order)
    return {"gpus": gpus, "links": links, "link_ranks": [list(x) for x in v.links],
            "slow_ranks": slow, "ranks": sorted(set(v.gpus)) or slow, "nodes": nodes}


def _node_order(n: int | str) -> tuple[bool, str]:
    """Node numbers in numeric order, then host names."""
    return isinstance(n, str), str(n).zfill(12)


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
    or raises when its consumer cannot go on (the process exits for its supervisor)."""
    validator = validator or Validator(ctx, settings)
    consumer: Consumer[Suspicion] = Consumer(ctx.js, VALIDATOR, Suspicion, validator.handle)

    async def stopper() -> None:
        await stop.wait()
        consumer.stop()

    await supervise(consumer.run(), stopper())
