"""A training job's side of the planner, over the REST API: declare the layout, fetch the plan
to run, report what applying it cost.

    client = PlanClient.from_env()          # GREYHOUND_API_URL, GREYHOUND_JOB_ID, GREYHOUND_API_TOKEN
    client.declare({"tp": 8, "dp": 16, "pp": 2, "gpus_per_node": 8, "microbatches": 64})
    follower = TorchPlanFollower(dp_rank=..., dp_size=16, microbatches=64,
                                 source=client.fetch, on_applied=client.on_applied, group=dp_group)
    # or, to follow S3 plans as well (greyhound.integrations.torch_layout):
    job = TorchLayoutFollower(shape=..., microbatches=64, build_stage=...,
                              source=client.fetch_delivery, on_report=client.on_outcome)

The token is a ``job`` token (``greyhound token create --role job``). Every call has a short
timeout and raises on failure; :class:`~greyhound.integrations.plan_follower.PlanFollower` turns
a raise into a warning, so a planner that is away never stops training.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import httpx

from greyhound.integrations.plan_follower import AppliedPlan, MicrobatchPlan
from greyhound.integrations.topology import Delivery, LayoutOutcome


class PlanClient:
    def __init__(self, base_url: str, job_id: str, token: str, *, timeout_s: float = 2.0,
                 client: httpx.Client | None = None) -> None:
        self.job_id = job_id
        self._base = f"{base_url.rstrip('/')}/v1/jobs/{job_id}"
        self._http = client or httpx.Client(timeout=timeout_s)
        self._headers = {"Authorization": f"Bearer {token}"}
        self.last: dict[str, Any] | None = None
        self._refused: set[int] = set()  # versions that move ranks, refused by fetch()
        self._micro: MicrobatchPlan | None = None  # the last micro-batch plan fetch() handed

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PlanClient:
        env = os.environ if environ is None else environ
        missing = [k for k in ("GREYHOUND_API_URL", "GREYHOUND_JOB_ID", "GREYHOUND_API_TOKEN")
                   if not env.get(k)]
        if missing:
            raise ValueError(f"set {', '.join(missing)} to reach the planner")
        return cls(env["GREYHOUND_API_URL"], env["GREYHOUND_JOB_ID"], env["GREYHOUND_API_TOKEN"])

    def declare(self, layout: Mapping[str, Any]) -> None:
        """The job's parallel layout (what the planner builds plans from); once at start."""
        r = self._http.put(f"{self._base}/layout", json=dict(layout), headers=self._headers)
        r.raise_for_status()

    def current(self) -> dict[str, Any]:
        """The job's current plan as the API returns it (version 0: none)."""
        r = self._http.get(f"{self._base}/plan", headers=self._headers)
        r.raise_for_status()
        body: dict[str, Any] = r.json()
        self.last = body
        return body

    def fetch(self) -> MicrobatchPlan | None:
        """A :class:`PlanFollower` source: the current micro-batch split, None before any plan
        (empty counts: back to the job's even split). Such a follower cannot move ranks: a
        version that does (``gpu_of_rank`` set) is reported ``failed`` once and the previous
        split stands, so the planner takes the plan back."""
        body = self.current()
        version = int(body.get("version") or 0)
        if version == 0:
            return None
        if body.get("gpu_of_rank") is not None:
            if version not in self._refused:
                try:
                    self.report(version, applied=False, error=(
                        "this job follows micro-batch plans only (TorchPlanFollower); moving ranks "
                        "needs greyhound.integrations.torch_layout.TorchLayoutFollower"))
                except httpx.HTTPStatusError as exc:
                    if exc.response.status_code not in (404, 409):  # 409: reported already
                        raise
                self._refused.add(version)
            return self._micro
        counts = body.get("microbatches")
        self._micro = MicrobatchPlan(version, tuple(int(c) for c in counts) if counts else ())
        return self._micro

    def fetch_delivery(self) -> Delivery | None:
        """A :class:`~greyhound.integrations.torch_layout.TorchLayoutFollower` source: the whole
        current delivery (micro-batches and rank -> GPU map), None before any plan."""
        body = self.current()
        if int(body.get("version") or 0) == 0:
            return None
        return Delivery.parse(body)

    def report(self, version: int, *, applied: bool = True, cost_s: float | None = None,
               error: str | None = None) -> None:
        body: dict[str, Any] = {"version": version, "outcome": "applied" if applied else "failed"}
        if cost_s is not None:
            body["cost_s"] = max(0.0, float(cost_s))
        if error is not None:
            body["error"] = error[:2000]
        r = self._http.post(f"{self._base}/plan/applied", json=body, headers=self._headers)
        r.raise_for_status()

    def on_applied(self, applied: AppliedPlan) -> None:
        """A :class:`PlanFollower` ``on_applied``: the group's first rank reports for the job."""
        if applied.dp_rank == 0:
            self.report(applied.version, cost_s=applied.cost_s)

    def on_outcome(self, outcome: LayoutOutcome) -> None:
        """A ``TorchLayoutFollower`` ``on_report``: applied with the pause it cost, or failed
        with why (the follower calls it on global rank 0 only)."""
        self.report(outcome.version, applied=outcome.applied, cost_s=outcome.cost_s,
                    error=outcome.error)

    def close(self) -> None:
        self._http.close()
