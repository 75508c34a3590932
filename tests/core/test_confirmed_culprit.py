"""What a confirmed verdict names in the job's hardware."""

from __future__ import annotations

from greyhound.core.confirmed_culprit import NamedGpu, name_culprit
from greyhound.core.placement import Placement


def _placed(n: int, per_node: int) -> dict[int, Placement]:
    return {r: Placement(host=f"sim-node{r // per_node}", device=r % per_node, node=r // per_node)
            for r in range(n)}


def test_links_are_node_pairs_once_and_ranks_are_the_slow_gpus() -> None:
    c = name_culprit([3], [(14, 22), (13, 21), (21, 13), (9, 17)], _placed(24, 8))
    assert c.links == [(1, 2)]  # four rank pairs, one congested node pair
    assert c.link_ranks == [(14, 22), (13, 21), (21, 13), (9, 17)]
    assert c.ranks == [3]  # the link's end ranks are not blamed
    assert c.slow_ranks == [3, 9, 13, 14, 17, 21, 22]
    assert c.nodes == [0, 1, 2]
    assert c.gpus == [NamedGpu(3, 0, "sim-node0", 3)]


def test_a_link_alone_names_its_end_ranks() -> None:
    c = name_culprit([], [(5, 9)], _placed(16, 4))
    assert c.ranks == [5, 9] and c.links == [(1, 2)]


def test_a_rank_placed_nowhere_is_named_by_its_rank() -> None:
    c = name_culprit([7], [(7, 2)], {2: Placement(host="h", device=0, node=None)})
    assert c.gpus == [NamedGpu(7, "rank7", None, None)]
    assert c.links == [("h", "rank7")] and c.nodes == ["h", "rank7"]
