"""A planner on a bus of its own (it binds the planner's durable) and a fresh database, fed by
hand: incidents written as the analyzer and validator write them, iteration batches as agents
publish them, reports as the API forwards them, each on the bus as the service that sends it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats.js.errors
import pytest
from nats.js import JetStreamContext
from sqlalchemy import select

from services.common.bus.auth import agent_user
from services.common.bus.client import BusClient, publish
from services.common.bus.contract import (
    DetectionEvent,
    IncidentEvent,
    IterationBatch,
    JobLayout,
    PlanMessage,
    PlanReport,
    Subjects,
)
from services.common.bus.streams import PLANS
from services.common.db import repository as repo
from services.common.db.documents import (
    Culprit,
    Detection,
    Empty,
    Evidence,
    Gpu,
    OperatorNote,
    Validation,
)
from services.common.db.models import Incident, Plan, PlanDelivery, Webhook
from services.common.embedded import OPERATOR
from services.common.runtime import ServiceContext, start_service
from services.common.settings import Settings
from services.planner.service import Planner, run_planner
from services.planner.settings import PlannerSettings
from tests.conftest import Bus, new_bus


@dataclass
class Rig:
    ctx: ServiceContext
    planner: Planner
    job: str
    bus: Bus
    iteration: int = 0
    seen: list[str] = field(default_factory=list)
    _as: dict[str, BusClient] = field(default_factory=dict)

    async def js(self, user: str = OPERATOR) -> JetStreamContext:
        """The bus as ``user`` (a service, an agent, or the operator who looks)."""
        if user not in self._as:
            self._as[user] = await self.bus.connect(user)
        return self._as[user].jetstream()

    async def close(self) -> None:
        for nc in self._as.values():
            await nc.close()
        self._as.clear()

    async def layout(self, **kw: Any) -> None:
        async with self.ctx.db()() as session:
            await repo.set_job_layout(session, self.job, JobLayout(**kw))
            await session.commit()

    async def webhook(self) -> None:
        async with self.ctx.db()() as session:
            session.add(Webhook(url="http://127.0.0.1:9/x", secret_enc="", events=[]))
            await session.commit()

    async def incident(self, *, kind: str, before_s: float, after_s: float,
                       gpus: Sequence[int] = (), links: Sequence[tuple[int, int]] = (),
                       gemm: dict[int, float] | None = None) -> str:
        """An incident as far as the validator takes it: detected, localised, validated."""
        detection = Detection(event_id=uuid.uuid4().hex, ranks=[0, 1], method="bocd-v",
                              before_s=before_s, after_s=after_s, healthy_s=before_s,
                              first_iteration=10, detected_iteration=12, change="onset")
        culprit = Culprit(gpus=[Gpu(rank=g, node=0, host="h", device=g) for g in gpus],
                          links=[], link_ranks=[list(x) for x in links],
                          ranks=list(gpus) or sorted({r for x in links for r in x}))
        validation = Validation(suspicion=uuid.uuid4().hex, verdict=kind,
                                gemm_s={str(r): t for r, t in (gemm or {}).items()})
        async with self.ctx.db()() as session:
            inc = await repo.open_incident(
                session, job_id=self.job, kind=kind, dedup_key=f"slowdown-{uuid.uuid4().hex}",
                severity=after_s / before_s, summary="test", culprit=culprit,
                evidence=Evidence(detection=detection, validation=validation),
                stage_detail=detection)
            await repo.add_timeline(session, inc, "localized", Empty())
            await repo.add_timeline(session, inc, "validated", validation)
            await session.commit()
        await self.announce(inc.id, "validated", kind)
        return inc.id

    async def announce(self, incident_id: str, stage: str, kind: str = "compute_slow") -> None:
        await publish(await self.js("analyzer"), Subjects.incident(self.job), IncidentEvent(
            job_id=self.job, incident_id=incident_id, stage=stage,
            kind=kind, severity=1.0, summary="test"))

    async def resolve(self, incident_id: str) -> None:
        """What the analyzer does on the tracker's recovery."""
        async with self.ctx.db()() as session:
            inc = await repo.get_incident_for_update(session, incident_id)
            assert inc is not None
            await repo.add_timeline(session, inc, "resolved", OperatorNote(by="test", note=""))
            await session.commit()
        await self.announce(incident_id, "resolved")

    async def recovery(self, before_s: float, after_s: float) -> None:
        await publish(await self.js("tracker"), Subjects.detection(self.job), DetectionEvent(
            job_id=self.job, kind="recovery", ranks=[0], first_iteration=1, detected_iteration=2,
            before_s=before_s, after_s=after_s, detected_ns=0, evidence={"change": "full"}))

    async def iterations(self, seconds: float, n: int) -> None:
        """``n`` iterations of every rank (0 and 1) at ``seconds`` each, as an agent sends."""
        its = list(range(self.iteration + 1, self.iteration + n + 1))
        self.iteration += n
        await publish(await self.js(agent_user("agent-1")), Subjects.iterations(self.job, "agent-1"),
                      IterationBatch(
            job_id=self.job, agent_id="agent-1", rank=[1] * n + [0] * n, iteration=its + its,
            end_ns=[0] * (2 * n), duration_s=[seconds] * (2 * n)))

    async def report(self, version: int, outcome: str = "applied", cost_s: float | None = None,
                     error: str | None = None) -> None:
        await publish(await self.js("api"), Subjects.plan_report(self.job), PlanReport(
            job_id=self.job, version=version, outcome=outcome,
            cost_s=cost_s, error=error, reporter="test-job"))

    async def plans(self) -> list[Plan]:
        async with self.ctx.db()() as session:
            rows = (await session.scalars(select(Plan).where(Plan.job_id == self.job)
                                          .order_by(Plan.created_at))).all()
        return list(rows)

    async def deliveries(self) -> list[PlanDelivery]:
        async with self.ctx.db()() as session:
            rows = (await session.scalars(select(PlanDelivery).where(PlanDelivery.job_id == self.job)
                                          .order_by(PlanDelivery.version))).all()
        return list(rows)

    async def incident_row(self, incident_id: str) -> Incident:
        async with self.ctx.db()() as session:
            inc = await repo.get_incident(session, incident_id)
        assert inc is not None
        return inc

    async def stages(self, incident_id: str) -> list[str]:
        return [e.stage for e in (await self.incident_row(incident_id)).timeline]

    async def last_plan_message(self, min_version: int = 1) -> PlanMessage:
        """The job's newest plan message once it has at least ``min_version``: the planner sends
        it through the outbox just after the commit the test saw, so it may lag a moment."""
        async def newest() -> PlanMessage | None:
            try:
                raw = await (await self.js()).get_last_msg(PLANS, Subjects.plan(self.job))
            except nats.js.errors.NotFoundError:
                return None
            assert raw.data is not None
            msg = PlanMessage.model_validate_json(raw.data)
            return msg if msg.version >= min_version else None

        found: PlanMessage = await self.wait(newest, f"plan message v{min_version}")
        return found

    async def s2_applied(self, gpu: int, *, cost_s: float) -> str:
        """A compute_slow incident of GPU ``gpu`` of a TP1 DP4 PP1 job on one node, whose S2
        plan the job applied at ``cost_s``: the incident's id."""
        await self.layout(tp=1, dp=4, pp=1, gpus_per_node=4, microbatches=16)
        inc = await self.incident(kind="compute_slow", before_s=1.0, after_s=2.0, gpus=[gpu])

        async def tracked() -> bool:
            return inc in self.planner.tracked

        async def applied() -> bool:
            return any(p.status == "applied" for p in await self.plans())

        await self.wait(tracked, "the escalation to start")
        await self.iterations(2.0, 4)
        await self.wait(self.deliveries, "the S2 delivery")
        await self.report(1, cost_s=cost_s)
        await self.wait(applied, "the plan applied")
        return inc

    async def wait(self, pred: Any, what: str, timeout_s: float = 30.0) -> Any:
        """Poll an async predicate until it returns something truthy."""
        box: list[Any] = [None]

        async def check() -> None:
            while not box[0]:
                box[0] = await pred()
                if not box[0]:
                    await asyncio.sleep(0.05)

        try:
            await asyncio.wait_for(check(), timeout_s)
        except TimeoutError:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}") from None
        return box[0]


# trust 1: the published break-even, which these flows count the loss against (the expected
# durations' own flow sets the default trust)
FAST = {"poll_s": 0.05, "s2_overhead_s": 3.0, "s3_overhead_s": 5.0, "s4_overhead_s": 1e6,
        "recheck_s": 0.0, "hold_max_s": 0.0, "trust": 1.0}


@dataclass
class Bench:
    bus: Bus
    db_url: str
    tmp_path: Path

    @asynccontextmanager
    async def planner(self, service: dict[str, Any] | None = None,
                      **settings: Any) -> AsyncIterator[Rig]:
        """A running planner (FAST settings, overridden by ``settings``; ``service``: the
        common settings, such as the outbox relay's pace), as the planner's bus user with the
        planner's durable."""
        config = PlannerSettings(**{**FAST, **settings})
        ctx = await start_service(
            "planner", Settings(nats_url=self.bus.url, database_url=self.db_url,
                                data_dir=self.tmp_path / "data", **(service or {})),
            backends=self.bus.backends("planner", self.db_url))
        job = f"pl-{uuid.uuid4().hex[:8]}"
        planner = Planner(ctx, config)
        stop = asyncio.Event()
        task = asyncio.create_task(run_planner(ctx, stop, planner=planner))
        rig = Rig(ctx, planner, job, self.bus)
        try:
            yield rig
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
            await rig.close()
            await ctx.close()


@pytest.fixture()
def bench(fresh_db_url: str, tmp_path: Path) -> Iterator[Bench]:
    """A bus per test: the planner's durable starts at this test's events."""
    with new_bus("gh-planner-") as bus:
        yield Bench(bus, fresh_db_url, tmp_path)


