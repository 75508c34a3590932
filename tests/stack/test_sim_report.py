"""What ``greyhound sim run`` prints for a person: the link a comm_slow names (by its nodes),
the GPUs a validated compute straggler names, how each incident ended and what it cost."""

from __future__ import annotations

from typing import Any

from stack.sim_live import text_report


def _line(kind: str, **kw: Any) -> dict[str, Any]:
    return {"kind": kind, "ranks": kw.get("ranks", [0, 1, 2, 3, 4, 5, 6, 7, 8]),
            "nodes": kw.get("nodes", []), "links": kw.get("links", []), "detected_s": 65.7,
            "localized_s": 70.0}


def test_the_text_names_the_link_the_gpu_and_the_cost() -> None:
    link = ({"culprit": {"links": [["sim-node0", "sim-node1"]]}, "status": "resolved",
             "cost": {"gpu_hours_lost": 0.2486, "gpu_hours_saved": 0.2303}})
    gpu = ({"culprit": {"ranks": [3], "gpus": [{"rank": 3, "host": "sim-node0", "device": 3}]},
            "status": "mitigated", "cost": {"gpu_hours_lost": 0.01, "gpu_hours_saved": None}})
    text = text_report("job-1", [(_line("comm_slow", links=[[0, 1]]), link),
                                 (_line("compute_slow", ranks=[3], nodes=[0]), gpu),
                                 (_line("slowdown"), {"status": "detected"})])
    lines = text.splitlines()
    assert lines[0] == "3 incident(s) for job job-1 (virtual seconds):"
    assert "comm_slow" in lines[1] and "link 0-1" in lines[1]
    assert "(resolved; 0.249 GPU-h lost, 0.230 saved by plans)" in lines[1]
    assert "GPU 0:3 (rank 3)" in lines[2] and "saved" not in lines[2]
    assert "ranks [0, 1, 2, 3, 4, 5, 6, 7] ..." in lines[3] and "(detected)" in lines[3]
