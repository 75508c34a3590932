"""What a confirmed verdict writes into the incident's culprit."""

from __future__ import annotations

from greyhound.core.verdict import ValidationVerdict
from services.common.db.models import Rank
from services.validator.service import culprit


def _ranks(n: int, per_node: int) -> list[Rank]:
    return [Rank(job_id="j", rank=r, host=f"sim-node{r // per_node}", node=r // per_node,
                 device=r % per_node, pid=100 + r, agent_id="a") for r in range(n)]


def test_links_are_node_pairs_once_and_ranks_are_the_slow_gpus() -> None:
    v = ValidationVerdict("mixed_slow", [3], [(14, 22), (13, 21), (21, 13), (9, 17)])
    c = culprit(v, _ranks(24, 8))
    assert c.links == [[1, 2]]  # four rank pairs, one congested node pair
    assert c.link_ranks == [[14, 22], [13, 21], [21, 13], [9, 17]]
    assert c.ranks == [3]  # the link's end ranks are not blamed
    assert c.slow_ranks == [3, 9, 13, 14, 17, 21, 22]
    assert c.nodes == [0, 1, 2]


def test_a_link_alone_names_its_end_ranks() -> None:
    c = culprit(ValidationVerdict("comm_slow", [], [(5, 9)]), _ranks(16, 4))
    assert c.ranks == [5, 9] and c.links == [[1, 2]]
