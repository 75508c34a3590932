"""Property tests of the O(1) P2P check plan: full coverage, disjoint rounds, constant round count."""

import random

import pytest

from greyhound.core.p2p_rounds import binary_tree_parents, ring_rounds, tree_rounds


def _assert_disjoint(rounds):
    for rnd in rounds:
        used = [r for pair in rnd for r in pair]
        assert len(used) == len(set(used)), f"a rank appears twice in round {rnd}"


def _ring_edges(ring):
    n = len(ring)
    return sorted((ring[i], ring[(i + 1) % n]) for i in range(n))


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 9, 16, 17, 255, 256])
def test_ring_covers_each_edge_once_in_constant_rounds(n):
    ring = list(range(n))
    random.Random(n).shuffle(ring)
    rounds = ring_rounds(ring)
    assert len(rounds) == (2 if n % 2 == 0 else 3)
    _assert_disjoint(rounds)
    assert sorted(p for rnd in rounds for p in rnd) == _ring_edges(ring)


def test_ring_with_global_rank_ids():
    ring = [40, 7, 13, 100, 2]
    rounds = ring_rounds(ring)
    assert len(rounds) == 3
    assert sorted(p for rnd in rounds for p in rnd) == _ring_edges(ring)


def test_degenerate_and_invalid_rings():
    assert ring_rounds([]) == []
    assert ring_rounds([3]) == []
    with pytest.raises(ValueError):
        ring_rounds([1, 2, 1])


def _random_tree(n, max_children, rng):
    parent = [-1] * n
    slots = {0: max_children}
    for child in range(1, n):
        p = rng.choice(sorted(k for k, v in slots.items() if v > 0))
        parent[child] = p
        slots[p] -= 1
        slots[child] = max_children
    return parent


@pytest.mark.parametrize("seed", range(20))
def test_tree_covers_each_edge_once_in_max_degree_rounds(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 300)
    parent = _random_tree(n, rng.choice([1, 2, 3]), rng)
    rounds = tree_rounds(parent)
    _assert_disjoint(rounds)
    edges = sorted((c, p) for c, p in enumerate(parent) if p >= 0)
    assert sorted(pair for rnd in rounds for pair in rnd) == edges
    degree = [0] * n
    for c, p in edges:
        degree[c] += 1
        degree[p] += 1
    assert len(rounds) == max(degree)
    assert len(rounds) <= 4  # NCCL trees: one parent and up to three children


@pytest.mark.parametrize(("n", "expected"), [(2, 1), (3, 2), (4, 2), (5, 3), (64, 3), (1000, 3)])
def test_binary_tree_needs_at_most_three_rounds(n, expected):
    rounds = tree_rounds(binary_tree_parents(n))
    _assert_disjoint(rounds)
    assert len(rounds) == expected
    assert sum(len(r) for r in rounds) == n - 1


def test_invalid_trees():
    with pytest.raises(ValueError):
        tree_rounds([1, 0])  # no root: a cycle
    with pytest.raises(ValueError):
        tree_rounds([-1, 5])
    with pytest.raises(ValueError):
        tree_rounds([-1, 2, 1])  # 1 and 2 form a cycle apart from the root
