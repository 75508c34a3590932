"""A short live run through the real stack: a slow GPU becomes an incident in the API, localised
to its rank and reported in virtual seconds after the fault began; the services never see the
fault list."""

from __future__ import annotations

import io
import json
import socket
from pathlib import Path

from services.common.settings import Settings
from stack.sim_live import run_live
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
    settings = Settings(database_url=pg_url, data_dir=tmp_path / "data", shm_dir=tmp_path / "shm")
    out, err = io.StringIO(), io.StringIO()
    rc = run_live(sc, settings, port=_free_port(), speed=None, as_json=True, out=out, err=err,
                  settle_s=4.0)
    assert rc == 0, err.getvalue()
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
