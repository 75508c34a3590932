"""A short live run through the real stack: a slow GPU becomes an incident in the API, localised
to its rank and reported in virtual seconds after the fault began; the services never see the
fault list; with ``--serve`` the services still answer after the run."""

from __future__ import annotations

import io
import json
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.common.settings import Settings
from stack.sim_live import run_live
from stack.up import Stack
from tests.conftest import TEST_TOKEN_KEY
from tests.sim.helpers import job, scenario


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_gpu_slow_becomes_a_localized_incident(pg_url: str, tmp_path: Path) -> None:
    j = job(tp=2, dp=2, pp=2, gpus_per_node=4, microbatches=4, microbatch_compute_s=0.05,
            dp_allreduce_bytes=1e8, pp_activation_bytes=1e6, optimizer_s=0.01,
            link_latency_us=5.0, nvlink_latency_us=1.0)
    sc = scenario(j, [{"kind": "gpu_slow", "rank": 3, "start_s": 30.0, "factor": 2.5}],
                  duration_s=60.0, name="stack-test", noise={"jitter_cv": 0.01, "gc_prob": 0.0})
    # no NATS URL: the embedded one in the data directory, with its users, as a user runs it
    settings = Settings(database_url=pg_url, token_key=TEST_TOKEN_KEY, data_dir=tmp_path / "data",
                        shm_dir=tmp_path / "shm")
    out, err = io.StringIO(), io.StringIO()
    served: list[Any] = []

    def after(stack: Stack, base: str) -> int:
        """``--serve``: the services still answer once the run has been reported."""
        assert not stack.dead()
        mine = [j["id"] for j in httpx.get(f"{base}/v1/jobs", timeout=10).json()
                if j["id"].startswith("sim-stack-test-")]  # the session's database has others
        served.append(httpx.get(f"{base}/v1/incidents", params={"job_id": mine[0]},
                                timeout=10).json())
        served.append(httpx.get(f"{base}/dashboard/", timeout=10).status_code)
        return 7

    rc = run_live(sc, settings, port=_free_port(), speed=None, as_json=True, out=out, err=err,
                  settle_s=4.0, after=after)
    assert rc == 7, err.getvalue()
    assert len(served[0]) == len(out.getvalue().splitlines()) and served[1] == 200
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    slow = [x for x in lines if x["kind"] in ("slowdown", "compute_slow", "mixed_slow")]
    assert slow, (out.getvalue(), err.getvalue())
    first = slow[0]
    assert set(first) == {"kind", "ranks", "nodes", "links", "detected_s", "localized_s"}
    assert 30.0 < first["detected_s"] <= 60.0
    if first["kind"] != "slowdown":  # localised before the run ended: it must name rank 3
        assert first["ranks"] == [3] and first["nodes"] == [0], first
        assert first["localized_s"] is not None and first["localized_s"] >= first["detected_s"]
    assert "speed" in err.getvalue() and not list((tmp_path / "shm").glob("sim-*/rank-*.ring"))


class _Behind:
    """The tracker's consumer as a stack that cannot keep up shows it: messages left unread."""

    def __init__(self, _stack: object) -> None:
        self.pending = 7

    def __enter__(self) -> _Behind:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def test_a_run_the_tracker_did_not_follow_says_so(pg_url: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that ends with telemetry the tracker has not read must not report a healthy job."""
    import stack.sim_live as sim_live

    monkeypatch.setattr(sim_live, "TrackerLag", _Behind)
    monkeypatch.setattr(sim_live, "FOLLOW_TIMEOUT_S", 1.0)
    j = job(tp=2, dp=2, pp=1, gpus_per_node=2, microbatches=4, microbatch_compute_s=0.02,
            dp_allreduce_bytes=1e6)
    sc = scenario(j, [], duration_s=10.0, name="behind-test")
    settings = Settings(database_url=pg_url, token_key=TEST_TOKEN_KEY, data_dir=tmp_path / "data",
                        shm_dir=tmp_path / "shm")
    out, err = io.StringIO(), io.StringIO()
    rc = run_live(sc, settings, port=_free_port(), speed=5.0, as_json=True, out=out, err=err,
                  settle_s=0.5)
    assert rc == 3, err.getvalue()
    assert "could not follow this run" in err.getvalue() and "7 telemetry messages" in \
        err.getvalue()
