"""The agent's control handler: requests from the validator and analyzer, acted on the rings.

Control travels on core NATS request/reply (a conversation with a deadline, not a stream to
replay), two subjects per job and agent: the control subject for status and mode, the
validation subject for what holds the job (pause, bench, resume), which only the validator may
publish to (server permissions), so a holding request on the control subject is refused. Every
request gets exactly one reply; anything wrong (unknown rank, a bad request, a full benchmark
table, a ring that fails while it is acted on) is an ``ok=False`` reply with the reason, never
an exception that would silence the agent. Benchmarks only run on parked ranks, so a bench
request for a rank that is not paused is refused instead of queued for some later pause.

Control blocks are keyed by file identity (device, inode), not path: after a rank restarts, its
new ring sits at the old path, and a pause meant for the live process must reach the live
process's file. Entries of files the collectors no longer serve are dropped at every sync.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Literal

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import ValidationError

from greyhound.hookabi import BenchKind, BenchRequest, BenchState, CommState, Control, FileId
from greyhound.hookabi.validation import sane_comm_rows
from services.agent.collector import Collector, RankStream
from services.common.bus.contract import (
    BenchItem,
    BenchOutcome,
    CommStatus,
    ControlReply,
    ControlRequest,
    GpuSample,
    RankStatus,
    Subjects,
)
from services.common.bus.control import HOLDING_ACTIONS

log = logging.getLogger(__name__)

POLL_S = 0.003  # benchmark results are polled; this keeps the event loop free between looks
MAX_IN_FLIGHT = 64  # requests answered at once; beyond, a request gets a "busy" reply
_KINDS = {"gemm": BenchKind.GEMM, "send": BenchKind.SEND, "recv": BenchKind.RECV,
          "drain": BenchKind.DRAIN, "split": BenchKind.SPLIT}
_STATES: dict[BenchState, Literal["done", "unsupported", "failed"]] = {
    BenchState.DONE: "done", BenchState.UNSUPPORTED: "unsupported", BenchState.FAILED: "failed"}


class ControlError(ValueError):
    """A request this agent cannot carry out; its message is the reply's error."""


class AgentControl:
    """Answers control requests for the jobs whose rings ``collectors`` (the agent's) hold."""

    def __init__(self, agent_id: str, collectors: dict[str, Collector], *,
                 clock: Callable[[], float] = time.monotonic,
                 gpu: Callable[[Collector, list[int] | None], Awaitable[list[GpuSample]]] | None = None,
                 ) -> None:
        self.agent_id = agent_id
        self._gpu = gpu  # GpuMonitor.samples: the "gpu" action's answer
        self.collectors = collectors
        self._clock = clock
        self._controls: dict[FileId, Control] = {}
        self._adopted: set[FileId] = set()  # rings whose leftover pause and mode were cleared
        self._orphans: dict[FileId, list[int]] = {}  # timed-out benchmark ids, freed when done
        self._subs: dict[str, list[Subscription]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.handled = 0

    # ---- bus --------------------------------------------------------------------------------

    async def sync_jobs(self, nc: NATS) -> None:
        """Subscribe for jobs the collectors serve now, unsubscribe from jobs they dropped, and
        forget control blocks of files no longer served (called after each ring scan)."""
        self.adopt_rings()
        for job in list(self.collectors):
            if job not in self._subs:
                self._subs[job] = [
                    await nc.subscribe(Subjects.control(job, self.agent_id), cb=self._on_msg),
                    await nc.subscribe(Subjects.validation(job, self.agent_id), cb=self._on_msg)]
        for job in [j for j in self._subs if j not in self.collectors]:
            for sub in self._subs.pop(job):
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        self.prune()

    def prune(self) -> None:
        """Drop what is held for files that no collector serves any more."""
        live = {s.file_id for col in self.collectors.values() for s in col.streams.values()}
        for fid in [f for f in self._controls if f not in live]:
            self._controls.pop(fid).close()
        for fid in [f for f in self._orphans if f not in live]:
            del self._orphans[fid]

    def adopt_rings(self) -> None:
        """Clear what an earlier agent left in rings this one meets for the first time: a pause
        (its validator gone with it, nobody would resume; the lease would, later) and profile
        mode (this agent publishes no collectives for it). Runs before any request is served."""
        live = {s.file_id: s for col in self.collectors.values() for s in col.streams.values()}
        for fid in live.keys() - self._adopted:
            try:
                ctl = self._control(live[fid])
                ctl.resume()
                ctl.set_mode("monitor")
            except Exception:  # one ring that cannot be written costs that ring only
                log.exception("could not clear the control block of %s", live[fid].path)
        self._adopted = set(live)

    async def _on_msg(self, msg: Msg) -> None:
        if len(self._tasks) >= MAX_IN_FLIGHT:
            with contextlib.suppress(Exception):
                await msg.respond(self._fail("busy: too many requests in flight").model_dump_json()
                                  .encode())
            return
        # A long benchmark must not hold up a status request: each request runs on its own.
        task = asyncio.create_task(self._respond(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _respond(self, msg: Msg) -> None:
        kind = msg.subject.split(".")[3] if msg.subject.count(".") >= 4 else ""
        reply = await self.answer(Subjects.job_of(msg.subject), msg.data,
                                  holding_allowed=kind == "validate")
        if msg.reply:
            try:
                await msg.respond(reply.model_dump_json().encode())
            except Exception:
                log.exception("could not reply to a control request on %s", msg.subject)

    async def close(self) -> None:
        for subs in self._subs.values():
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        self._subs.clear()
        for task in list(self._tasks):
            task.cancel()
        for ctl in self._controls.values():
            ctl.close()
        self._controls.clear()

    # ---- requests ---------------------------------------------------------------------------

    async def answer(self, job: str, data: bytes, *, holding_allowed: bool = True) -> ControlReply:
        """The reply to one raw request addressed to ``job``; ``holding_allowed`` is False for
        requests that came on the control subject, where pause, bench and resume are refused."""
        self.handled += 1
        try:
            req = ControlRequest.model_validate_json(data)
        except ValidationError as exc:
            errs = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                             for e in exc.errors()[:5])
            return self._fail(f"bad request: {errs}")
        try:
            if req.job_id != job:
                raise ControlError(f"request for job {req.job_id} sent on job {job}'s subject")
            if req.action in HOLDING_ACTIONS and not holding_allowed:
                raise ControlError(f"{req.action} is accepted only on the validation subject "
                                   f"({Subjects.validation(job, self.agent_id)})")
            return await self._dispatch(req)
        except ControlError as exc:
            return self._fail(str(exc))
        except Exception as exc:  # a bug here must cost one reply, not the agent
            log.exception("control %s for job %s failed", req.action, job)
            return self._fail(f"{type(exc).__name__}: {exc}")

    def _fail(self, error: str) -> ControlReply:
        return ControlReply(ok=False, error=error, agent_id=self.agent_id)

    async def _dispatch(self, req: ControlRequest) -> ControlReply:
        streams = self._streams(req.job_id)
        if req.action == "gpu":
            gpus = await self._gpu(self.collectors[req.job_id], req.ranks) if self._gpu else []
            return ControlReply(ok=True, agent_id=self.agent_id, gpus=gpus)
        if req.action == "bench":
            return await self._bench(req, streams)
        targets = self._targets(req, streams)
        if req.action == "set_mode":
            if req.mode is None:
                raise ControlError("set_mode needs mode")
            for s in targets:
                self._control(s).set_mode(req.mode)
                s.keep_records = req.mode == "profile"
        elif req.action == "pause":
            self._pause(req, targets)
        elif req.action == "resume":
            for s in targets:
                self._control(s).resume()
        return ControlReply(ok=True, agent_id=self.agent_id,
                            ranks=[self._status(s) for s in targets])

    def _streams(self, job: str) -> dict[int, RankStream]:
        col = self.collectors.get(job)
        if col is None or not col.streams:
            raise ControlError(f"agent {self.agent_id} serves no rank of job {job}")
        return {s.rank: s for s in col.streams.values()}

    def _targets(self, req: ControlRequest, streams: dict[int, RankStream]) -> list[RankStream]:
        if req.ranks is None:
            return [streams[r] for r in sorted(streams)]
        unknown = sorted(set(req.ranks) - set(streams))
        if unknown:
            raise ControlError(f"ranks {unknown} of job {req.job_id} are not on agent "
                               f"{self.agent_id} (it has {sorted(streams)})")
        return [streams[r] for r in sorted(set(req.ranks))]

    def _control(self, stream: RankStream) -> Control:
        ctl = self._controls.get(stream.file_id)
        if ctl is None:
            ctl = self._controls[stream.file_id] = stream.reader.control()
        return ctl

    def _status(self, s: RankStream) -> RankStatus:
        # destroyed or aborted communicators can neither pause nor bench
        comms = [CommStatus(comm_id=int(c["comm_id"]), comm_rank=int(c["rank"]),
                            nranks=int(c["nranks"]), last_seq_entered=int(c["last_seq_entered"]),
                            last_seq_completed=int(c["last_seq_completed"]))
                 for c in sane_comm_rows(s.reader.comms()) if int(c["state"]) == CommState.ACTIVE]
        h = s.reader.header
        ctl = self._control(s)
        return RankStatus(rank=s.rank, host=h.host, device=h.device,
                          mode="profile" if s.keep_records else "monitor",
                          paused=ctl.paused(), comms=comms, job_timeout_s=ctl.job_timeout_s())

    def _pause(self, req: ControlRequest, targets: list[RankStream]) -> None:
        missing = [s.rank for s in targets if s.rank not in req.pause_comm_id]
        if len(targets) > 1 and missing:
            raise ControlError(f"pausing several ranks needs pause_comm_id for each (a plain "
                               f"pause parks ranks at different calls and deadlocks their "
                               f"peers); missing for ranks {missing}")
        for s in targets:
            self._control(s).pause(req.pause_comm_id.get(s.rank, 0), req.pause_seq,
                                   lease_s=req.lease_s)

    # ---- benchmarks -------------------------------------------------------------------------

    async def _bench(self, req: ControlRequest, streams: dict[int, RankStream]) -> ControlReply:
        if not req.bench:
            raise ControlError("bench needs at least one item")
        items = self._bench_items(req, streams)
        for rank in sorted({it.rank for it in items}):
            if not self._control(streams[rank]).paused():
                raise ControlError(f"rank {rank} is not paused: benchmarks run only on parked "
                                   "ranks")
        for s in {streams[it.rank].file_id: streams[it.rank] for it in items}.values():
            self._reap(s)
        submitted: list[tuple[BenchItem, RankStream, int]] = []
        try:
            for it in items:
                s = streams[it.rank]
                req_id = self._control(s).submit(BenchRequest(
                    kind=_KINDS[it.kind], size=it.size, repeat=it.repeat, comm_id=it.comm_id,
                    peer=it.peer))
                submitted.append((it, s, req_id))
        except (RuntimeError, ValueError) as exc:  # all slots busy, or a bad ring or size
            for _, s, req_id in submitted:
                self._orphans.setdefault(s.file_id, []).append(req_id)
            raise ControlError(f"cannot submit benchmarks: {exc}") from exc
        outcomes = await self._collect(submitted, req.timeout_s)
        return ControlReply(ok=True, agent_id=self.agent_id, results=outcomes,
                            ranks=[self._status(streams[r]) for r in
                                   sorted({it.rank for it in items})])

    def _bench_items(self, req: ControlRequest, streams: dict[int, RankStream]) -> list[BenchItem]:
        """Items for ranks here. Without ``ranks``, the request may be one shared by several
        agents (control.request_all), so items for other agents' ranks are left to them."""
        if req.ranks is None:
            items = [it for it in req.bench if it.rank in streams]
            if not items:
                raise ControlError(f"no bench item names a rank on agent {self.agent_id}")
            return items
        allowed = {s.rank for s in self._targets(req, streams)}
        stray = sorted({it.rank for it in req.bench} - allowed)
        if stray:
            raise ControlError(f"bench items for ranks {stray} outside the request's ranks")
        return list(req.bench)

    async def _collect(self, submitted: list[tuple[BenchItem, RankStream, int]],
                       timeout_s: float) -> list[BenchOutcome]:
        done: dict[int, BenchOutcome] = {}
        deadline = self._clock() + timeout_s
        while True:
            for i, (it, s, req_id) in enumerate(submitted):
                if i in done:
                    continue
                res = self._control(s).result(req_id)
                if res is not None:
                    done[i] = BenchOutcome(item=it, state=_STATES[res.state],
                                           durations_ns=list(res.durations_ns),
                                           drain_ns=res.drain_ns)
            if len(done) == len(submitted) or self._clock() >= deadline:
                break
            await asyncio.sleep(POLL_S)
        out: list[BenchOutcome] = []
        for i, (it, s, req_id) in enumerate(submitted):
            if i in done:
                out.append(done[i])
            else:
                self._orphans.setdefault(s.file_id, []).append(req_id)
                out.append(BenchOutcome(item=it, state="timeout"))
        return out

    def _reap(self, s: RankStream) -> None:
        """Free the slots of earlier timed-out requests that have finished since."""
        ids = self._orphans.get(s.file_id)
        if not ids:
            return
        ctl = self._control(s)
        keep: list[int] = []
        for req_id in ids:
            try:
                if ctl.result(req_id) is None:
                    keep.append(req_id)
            except KeyError:
                pass
        self._orphans[s.file_id] = keep
