"""The job's REST client: what it sends (route, token, body), how a plan and its revert reach
the follower, and that a planner that is away leaves training alone."""

from __future__ import annotations

import json

import httpx
import pytest

from greyhound.integrations.plan_follower import PlanFollower
from greyhound.integrations.rest import PlanClient


class FakeApi:
    """The three routes, answering what a planner would have delivered."""

    def __init__(self) -> None:
        self.plans = [{"version": 0, "microbatches": None},
                      {"version": 1, "microbatches": [5, 3, 4, 4]},
                      {"version": 2, "microbatches": None}]
        self.calls: list[tuple[str, str, object]] = []
        self.down = False

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("planner away", request=request)
        assert request.headers["authorization"] == "Bearer gh_job"
        body = json.loads(request.content) if request.content else None
        self.calls.append((request.method, request.url.path, body))
        if request.method == "GET":
            return httpx.Response(200, json=self.plans[0] if len(self.plans) == 1
                                  else self.plans.pop(0))
        return httpx.Response(202 if request.method == "POST" else 200, json={})


def _client(api: FakeApi) -> PlanClient:
    return PlanClient("http://api:8000/", "job-7", "gh_job",
                      client=httpx.Client(transport=httpx.MockTransport(api)))


def test_a_plan_and_its_revert_reach_the_follower_and_are_reported_once() -> None:
    api = FakeApi()
    client = _client(api)
    client.declare({"tp": 1, "dp": 4, "pp": 1, "gpus_per_node": 4, "microbatches": 16})
    f = PlanFollower(dp_rank=0, dp_size=4, microbatches=16, source=client.fetch,
                     on_applied=client.on_applied)
    assert [f.next_iteration() for _ in range(3)] == [4, 5, 4]  # even, the plan, back to even
    assert f.version == 2 and f.counts == (4, 4, 4, 4)
    posts = [(p, b) for m, p, b in api.calls if m == "POST"]
    assert [b["version"] for _, b in posts] == [1, 2]
    assert all(p == "/v1/jobs/job-7/plan/applied" for p, _ in posts)
    assert all(b["outcome"] == "applied" and b["cost_s"] >= 0 for _, b in posts)
    assert api.calls[0] == ("PUT", "/v1/jobs/job-7/layout", {
        "tp": 1, "dp": 4, "pp": 1, "gpus_per_node": 4, "microbatches": 16})


def test_only_the_first_dp_rank_reports_and_an_absent_planner_is_a_warning() -> None:
    api = FakeApi()
    client = _client(api)
    f = PlanFollower(dp_rank=2, dp_size=4, microbatches=16, source=client.fetch,
                     on_applied=client.on_applied)
    f.next_iteration()
    f.next_iteration()
    assert f.counts == (5, 3, 4, 4) and not [c for c in api.calls if c[0] == "POST"]
    api.down = True
    errors: list[Exception] = []
    g = PlanFollower(dp_rank=0, dp_size=4, microbatches=16, source=client.fetch,
                     on_error=errors.append)
    assert g.next_iteration() == 4 and isinstance(errors[0], httpx.ConnectError)


def test_from_env_names_what_is_missing() -> None:
    with pytest.raises(ValueError, match="GREYHOUND_API_TOKEN"):
        PlanClient.from_env({"GREYHOUND_API_URL": "http://x", "GREYHOUND_JOB_ID": "j"})
    c = PlanClient.from_env({"GREYHOUND_API_URL": "http://x", "GREYHOUND_JOB_ID": "j",
                             "GREYHOUND_API_TOKEN": "t"})
    assert c.job_id == "j"


def test_the_whole_delivery_reaches_a_layout_follower_and_its_outcomes_are_reported() -> None:
    from greyhound.integrations.topology import Delivery, LayoutOutcome

    api = FakeApi()
    api.plans = [{"version": 0, "microbatches": None, "gpu_of_rank": None},
                 {"version": 4, "strategy": "S3", "action": "apply", "microbatches": None,
                  "gpu_of_rank": [0, 2, 1, 3], "swaps": [[1, 2]], "cost_s": 60.0}]
    client = _client(api)
    assert client.fetch_delivery() is None
    assert client.fetch_delivery() == Delivery(4, None, (0, 2, 1, 3), ((1, 2),), "S3", "apply")
    client.on_outcome(LayoutOutcome(4, True, 0.12, None, 6, True, (1, 2), 5328))
    client.on_outcome(LayoutOutcome(5, False, 0.3, "process 1: out of memory", 7, False, (), 0))
    posts = [b for m, _, b in api.calls if m == "POST"]
    assert posts == [{"version": 4, "outcome": "applied", "cost_s": 0.12},
                     {"version": 5, "outcome": "failed", "cost_s": 0.3,
                      "error": "process 1: out of memory"}]


def test_a_micro_batch_follower_refuses_a_version_that_moves_ranks_once() -> None:
    api = FakeApi()
    s3 = {"version": 2, "strategy": "S3", "microbatches": [5, 3, 4, 4], "gpu_of_rank": [0, 2, 1, 3]}
    api.plans = [{"version": 1, "microbatches": [5, 3, 4, 4]}, s3, s3,
                 {"version": 3, "microbatches": [5, 3, 4, 4], "gpu_of_rank": None}]
    client = _client(api)
    f = PlanFollower(dp_rank=0, dp_size=4, microbatches=16, source=client.fetch,
                     on_applied=client.on_applied)
    assert [f.next_iteration() for _ in range(4)] == [5, 5, 5, 5]
    assert f.version == 3
    posts = [b for m, _, b in api.calls if m == "POST"]
    assert [(b["version"], b["outcome"]) for b in posts] == [(1, "applied"), (2, "failed"),
                                                              (3, "applied")]
    assert "micro-batch plans only" in posts[1]["error"]
