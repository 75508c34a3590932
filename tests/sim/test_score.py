"""Scoring incidents against the injected faults: the first localisation that names a fault with
the right kind, its detection and validation times, compound episodes."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from greyhound.sim.score import expectations, score_faults
from tests.sim.helpers import job, scenario

BASE = 1_800_000_000.0  # wall seconds at virtual 0


def at(v: float) -> str:
    return datetime.fromtimestamp(BASE + v, UTC).isoformat()


def virtual_at(wall_ns: int) -> float:
    return wall_ns / 1e9 - BASE


def incident(ident: str, opened: float, entries: list[tuple[str, float, dict[str, Any]]],
             kind: str = "compute_slow") -> dict[str, Any]:
    return {"id": ident, "kind": kind, "opened_at": at(opened),
            "timeline": [{"stage": s, "at": at(v), "detail": d} for s, v, d in entries]}


def localized(kind: str, ranks: list[int] = (), links: list[list[str]] = ()) -> dict[str, Any]:
    nodes = sorted({n for pair in links for n in pair})
    return {"kind": kind, "culprit": {"ranks": list(ranks), "compute_ranks": list(ranks),
                                      "nodes": nodes, "links": [list(x) for x in links]}}


SC = scenario(job(tp=2, dp=4, pp=2, gpus_per_node=4, microbatches=8), [
    {"kind": "gpu_slow", "rank": 3, "start_s": 10, "duration_s": 40, "factor": 2.0},
    {"kind": "link_congestion", "nodes": [0, 1], "start_s": 30, "duration_s": 40, "factor": 8},
    {"kind": "gpu_slow", "rank": 9, "start_s": 80, "duration_s": 10, "factor": 2.0},
])


def test_each_fault_is_named_by_its_first_right_localisation_with_its_times() -> None:
    incidents = [
        incident("a", 14.0, [("detected", 14.0, {}), ("localized", 17.5, localized(
            "compute_slow", [3])), ("validated", 21.0, {"verdict": "compute_slow"})]),
        # the congestion noted into nothing: its own incident, named as a link of sim-nodes
        incident("b", 36.0, [("detected", 36.0, {}), ("localized", 38.0, localized(
            "comm_slow", links=[["sim-node0", "sim-node1"]])),
            ("validated", 45.0, {"verdict": "transient"}),
            ("validated", 47.0, {"verdict": "comm_slow"})], kind="comm_slow"),
        # the third fault: first another rank, then its rank under a wrong kind
        incident("c", 84.0, [("detected", 84.0, {}), ("localized", 86.0, localized(
            "compute_slow", [8])), ("localized", 88.0, localized("comm_slow", [9]))]),
    ]
    found = score_faults(SC, incidents, virtual_at)
    first, link, third = found
    assert first.correct and first.incident_id == "a"
    assert (first.detect_s, first.localize_s, first.validate_s) == (4.0, 7.5, 11.0)
    # overlapping the GPU fault, the link may be named as its own kind (compound="either")
    assert link.correct and link.kind == "comm_slow"
    assert (link.detect_s, link.localize_s, link.validate_s) == (6.0, 8.0, 17.0)
    assert not third.correct and third.culprit_ok and not third.kind_ok
    assert third.incident_id == "c" and third.localize_s is None


def test_a_fault_noted_into_an_open_incident_is_timed_from_the_note() -> None:
    merged = localized("mixed_slow", [3], links=[["sim-node0", "sim-node1"]])
    incidents = [incident("a", 14.0, [
        ("detected", 14.0, {}), ("localized", 17.0, localized("compute_slow", [3])),
        ("detected", 35.0, {"further": True}), ("localized", 39.0, merged)])]
    link = score_faults(SC, incidents, virtual_at)[1]
    assert link.correct and link.kind == "mixed_slow"
    assert (link.detect_s, link.localize_s) == (5.0, 9.0)


def test_nothing_found_and_entries_from_before_the_onset_do_not_count() -> None:
    early = [incident("x", 70.0, [("localized", 70.0, localized("compute_slow", [9]))])]
    assert not score_faults(SC, early, virtual_at)[2].correct
    assert [f.correct for f in score_faults(SC, [], virtual_at)] == [False, False, False]


def test_the_localisation_reports_rule_asks_mixed_for_both_sides_of_a_compound() -> None:
    strict = expectations(SC)
    assert [e.kinds for e in strict] == [{"mixed_slow"}, {"mixed_slow"}, {"compute_slow"}]
    either = expectations(SC, compound="either")
    assert [e.kinds for e in either] == [{"compute_slow", "mixed_slow"},
                                         {"comm_slow", "mixed_slow"}, {"compute_slow"}]


def test_a_gpu_that_a_topology_plan_moved_is_named_by_the_rank_it_runs() -> None:
    """From 60 s on GPU 9 runs rank 13 (an S3 swap of GPUs 9 and 13): the third fault, on GPU 9
    at 80 s, is named right as rank 13, and wrong as rank 9."""
    def rank_of_gpu(t: float) -> list[int]:
        ranks = list(range(16))
        if t >= 60.0:
            ranks[9], ranks[13] = 13, 9
        return ranks

    def third(rank: int) -> bool:
        incidents = [incident("c", 84.0, [("detected", 84.0, {}), ("localized", 86.0, localized(
            "compute_slow", [rank]))])]
        return score_faults(SC, incidents, virtual_at, rank_of_gpu=rank_of_gpu)[2].correct

    assert third(13) and not third(9)
