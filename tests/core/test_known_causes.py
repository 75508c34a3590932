"""A second fault's localisation names only what the open incidents do not; a partial recovery
closes the incident whose step matches the fall."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from greyhound.core.known_causes import KnownCauses, OpenStep, ended_by, new_causes
from greyhound.core.slow_localization import NodeLabel, SlowLocalization

COMM = -5  # signed in the cores, unsigned (2**64 - 5) in incidents
U_COMM = (1 << 64) - 5


def _loc(**kw: object) -> SlowLocalization:
    base: dict[str, object] = {
        "kind": "mixed_slow", "transient": False, "ranks": [9, 32, 33, 40, 41],
        "compute_ranks": [9], "comm_ids": [COMM], "slow_groups": [COMM], "nodes": [1, 4, 5],
        "links": [(4, 5)], "evidence": {"calls": 10}}
    base.update(kw)
    return SlowLocalization(**base)


@dataclass(frozen=True)
class Named:
    """What an open incident's culprit names."""

    compute_ranks: Sequence[int] = ()
    comm_ids: Sequence[int] = ()
    nodes: Sequence[NodeLabel] = ()
    links: Sequence[Sequence[NodeLabel]] = ()


GPU_INCIDENT = ("inc-gpu", Named(compute_ranks=[9], nodes=[1]))
LINK_INCIDENT = ("inc-link", Named(comm_ids=[U_COMM], nodes=[4, 5], links=[[5, 4]]))


def test_the_known_gpu_is_subtracted_and_the_link_is_the_new_cause() -> None:
    out = new_causes(_loc(), KnownCauses.from_culprits([GPU_INCIDENT]))
    assert out.kind == "comm_slow"
    assert out.compute_ranks == [] and out.comm_ids == [COMM] and out.links == [(4, 5)]
    assert out.ranks == [32, 33, 40, 41] and out.nodes == [4, 5]
    assert out.evidence["known"]["incidents"] == ["inc-gpu"] and "known_only" not in out.evidence


def test_a_second_gpu_is_new_and_the_first_one_is_not() -> None:
    loc = _loc(kind="compute_slow", ranks=[9, 42], compute_ranks=[9, 42], comm_ids=[],
               slow_groups=[], nodes=[1, 5], links=[])
    out = new_causes(loc, KnownCauses.from_culprits([GPU_INCIDENT]))
    assert (out.kind, out.compute_ranks, out.ranks, out.nodes) == ("compute_slow", [42], [42],
                                                                  [5])


def test_nothing_new_is_known_only_not_transient() -> None:
    known = KnownCauses.from_culprits([GPU_INCIDENT, LINK_INCIDENT])
    out = new_causes(_loc(), known)
    assert out.kind == "none" and not out.transient and out.evidence["known_only"]
    assert out.links == [] and out.comm_ids == [] and out.compute_ranks == []


def test_a_known_link_makes_its_communicators_known() -> None:
    """Another communicator through the same congested link is the same cause."""
    loc = _loc(kind="comm_slow", compute_ranks=[], comm_ids=[-7], slow_groups=[-7],
               links=[(5, 4)])
    out = new_causes(loc, KnownCauses.from_culprits([LINK_INCIDENT]))
    assert out.kind == "none" and out.evidence["known_only"]


def test_without_known_causes_the_localisation_is_unchanged() -> None:
    loc = _loc()
    assert new_causes(loc, KnownCauses()) is loc
    assert new_causes(_loc(kind="none", compute_ranks=[], comm_ids=[], links=[]),
                      KnownCauses.from_culprits([GPU_INCIDENT])).kind == "none"


def test_partial_recovery_ends_the_incident_whose_step_matches() -> None:
    steps = [OpenStep("gpu", 0.245, 0.301), OpenStep("link", 0.301, 0.39)]
    assert ended_by(steps, 0.39, 0.30) == "link"  # back where it was before the link
    assert ended_by(steps, 0.39, 0.305) == "link"
    assert ended_by(steps, 0.39, 0.33) == "gpu"   # nearer 0.39 / (0.301 / 0.245)
    assert ended_by([OpenStep("a", 0.0, 0.0)], 0.39, 0.30) is None
    assert ended_by(steps, 0.0, 0.3) is None
    # equal steps: the newer incident
    assert ended_by([OpenStep("old", 1.0, 1.2), OpenStep("new", 1.2, 1.44)], 1.44, 1.2) == "new"
