"""The simulated job as a plan follower: what a training framework does with Greyhound's plans,
done to a live simulation.

It declares the scenario's layout, looks at its current plan over REST every ``poll_s`` (the
same client and route a PyTorch job uses: greyhound.integrations.rest), turns a new version into
simulator plans (micro-batch counts; GPU swaps from the layout it runs to the one delivered),
hands them to the simulation, which applies them at the next iteration boundary with their
modelled cost, and reports each version applied (or failed) with that cost in virtual seconds.
A planner or API that does not answer is logged and retried; the simulated job runs on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from greyhound.core.layout import swaps_between
from greyhound.core.plans import MicrobatchPlan, Plan, SwapGpusPlan, even_split
from greyhound.integrations.rest import PlanClient
from greyhound.sim.live import LiveSimulation
from greyhound.sim.scenario import JobSpec
from services.api.tokens import check_scope, display_prefix, hash_token, new_token
from services.common.db import repository as repo
from services.common.db.session import make_engine, make_sessionmaker
from services.common.unit_of_work import Work

log = logging.getLogger(__name__)


def layout_of(job: JobSpec) -> dict[str, Any]:
    """The scenario's job as it declares itself (PUT /v1/jobs/{id}/layout)."""
    return {"tp": job.tp, "dp": job.dp, "pp": job.pp, "gpus_per_node": job.gpus_per_node,
            "microbatches": job.microbatches, "multiple_of": 1,
            "dp_allreduce_bytes": job.dp_allreduce_bytes,
            "pp_activation_bytes": job.pp_activation_bytes}


def mint_token(database_url: str, *, role: str, name: str, token_key: bytes | None,
               created_by: str = "sim", job_id: str | None = None) -> str:
    """A token made straight in the database, as ``greyhound token create`` does (a job token
    names its ``job_id``)."""
    check_scope(role, job_id)
    async def make() -> str:
        engine = make_engine(database_url)
        try:
            secret = new_token()
            async with Work(make_sessionmaker(engine)).unit() as uow:
                await repo.create_token(uow.session, name=name, role=role,
                                        token_hash=hash_token(secret, token_key),
                                        prefix=display_prefix(secret), created_by=created_by,
                                        expires_at=None, job_id=job_id)
            return secret
        finally:
            await engine.dispose()

    return asyncio.run(make())


@dataclass
class Step:
    """One version the simulated job ran: when (virtual s), at what cost, what it was."""

    version: int
    action: str
    strategy: str | None
    plan_id: str | None
    virtual_s: float
    cost_s: float
    error: str | None = None


@dataclass
class SimPlanFollower:
    sim: LiveSimulation
    client: PlanClient
    poll_s: float = 0.25
    version: int = 0
    steps: list[Step] = field(default_factory=list)
    _next_poll: float = 0.0
    _pending: dict[int, dict[str, Any]] = field(default_factory=dict)
    _counts: tuple[int, ...] = ()
    _gpus: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def __post_init__(self) -> None:
        job = self.sim.scenario.job
        self._counts = even_split(job.microbatches, job.dp)
        self._gpus = np.arange(job.world, dtype=np.int64)

    def start(self) -> None:
        self.client.declare(layout_of(self.sim.scenario.job))

    def poll(self) -> None:
        """Report what the simulation applied, and look for a new version when due; call it
        from the run's callbacks (it never raises for the API's sake)."""
        try:
            self._report()
            if time.monotonic() >= self._next_poll:
                self._next_poll = time.monotonic() + self.poll_s
                self._look()
        except httpx.HTTPError as exc:
            log.warning("simulated job %s: planner not reachable: %s", self.client.job_id, exc)

    def _look(self) -> None:
        body = self.client.current()
        version = int(body.get("version") or 0)
        if version <= self.version:
            return
        self.version = version
        self._pending[version] = body
        self.sim.submit(version, self._translate(body))

    def _translate(self, body: dict[str, Any]) -> list[Plan]:
        job = self.sim.scenario.job
        plans: list[Plan] = []
        counts = tuple(body.get("microbatches") or even_split(job.microbatches, job.dp))
        if counts != self._counts:
            plans.append(MicrobatchPlan(counts))
            self._counts = counts
        target = np.asarray(body.get("gpu_of_rank") or np.arange(job.world), dtype=np.int64)
        if target.shape == self._gpus.shape and not np.array_equal(target, self._gpus):
            plans.append(SwapGpusPlan(swaps_between(self._gpus, target)))
            self._gpus = target
        return plans

    def _report(self) -> None:
        for a in self.sim.applied():
            version = a.tag
            body = self._pending.pop(version, {})
            self.steps.append(Step(version, str(body.get("action")), body.get("strategy"),
                                   body.get("plan_id"), a.virtual_s, a.cost_s, a.error))
            self.client.report(version, applied=a.error is None, cost_s=a.cost_s, error=a.error)
            log.info("simulated job %s: version %d (%s %s) in force from %.1f s virtual, "
                     "cost %.2f s", self.client.job_id, version, body.get("action"),
                     body.get("strategy"), a.virtual_s, a.cost_s)


