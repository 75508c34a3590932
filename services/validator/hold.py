"""The validator's hold on a job: pause every rank at one iteration boundary, time GEMMs on the
suspect GPUs and P2P rounds on their links on the GPU, resume (always), judge with the pure
verdict core (greyhound.core.verdict). What to pause, benchmark and compare is decided from the
ranks' status alone (greyhound.core.validation_plan); the job is held only between the pause
and the resume, a span kept as evidence (``pause_s``).

The host parks at an NCCL boundary while GPU work it already enqueued keeps running (NCCL is
asynchronous), so each rank first waits for its queued GPU work to drain, then times the
benchmarks on the GPU; the wait is no part of any duration (each rank's is kept: ``drain_s``).
A transfer's time is its best repeat: the end that starts first waits for its peer inside its
timed kernel, and back-to-back repeats start together. Transfers run on benchmark communicators
split from the job's (never on its own: a send whose peer never posts would hold every later
training collective behind it), after every rank of the communicator drained. The hold lasts at
most ``pause_budget_s`` and never more than a quarter of the collective timeout the ranks
report; it is refused when that leaves less than ``min_pause_s``. A check that cannot finish (an
agent gone, the budget spent) is abandoned with the job resumed (an absent agent's ranks at
their lease's end).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NATS

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
from services.common.bus.contract import (
    BenchItem,
    BenchOutcome,
    ControlReply,
    ControlRequest,
    RankStatus,
    Suspicion,
)
from services.common.bus.control import ControlTimeout, request
from services.common.db.models import Rank
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


class Hold:
    """Validations of suspicions on their jobs, over the bus (see the module docstring)."""

    def __init__(self, nc: NATS, config: ValidatorSettings) -> None:
        self.nc = nc
        self.config = config

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
            reply = await request(self.nc, agent, req)
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
                await request(self.nc, agent, ControlRequest(job_id=job, action="resume",
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
