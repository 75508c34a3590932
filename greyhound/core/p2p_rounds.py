"""GREYHOUND's O(1) P2P check plan: the links of a ring or tree split into non-overlapping rounds.

Checking every pair of a group is O(N^2). The validator only needs the links that the collective
really uses, and a link is measured fairly only when neither end is busy with another transfer.
So the edges of the ring (or tree) are coloured so that no rank appears twice in one round; every
round then runs all its send/recv pairs in parallel, and the number of rounds does not grow with
the group size: an even ring needs 2 rounds, an odd ring 3, a tree at most its maximum degree
(4 for NCCL's trees: one parent and up to three children).
"""

from __future__ import annotations

from collections.abc import Sequence

Pair = tuple[int, int]
Rounds = list[list[Pair]]


def ring_rounds(ring: Sequence[int]) -> Rounds:
    """Rounds of (src, dst) pairs covering each directed ring edge ring[i] -> ring[i+1] once.

    Alternate edges go to rounds 0 and 1; an odd ring has one edge left whose ends both already
    appear in rounds 0 and 1 (it closes the cycle), so it gets a third round of its own.
    """
    members = [int(r) for r in ring]
    if len(set(members)) != len(members):
        raise ValueError("a ring visits each rank once")
    n = len(members)
    if n < 2:
        return []
    edges = [(members[i], members[(i + 1) % n]) for i in range(n)]
    if n % 2 == 0:
        return [edges[0::2], edges[1::2]]
    return [edges[0 : n - 1 : 2], edges[1 : n - 1 : 2], [edges[n - 1]]]


def tree_rounds(parent: Sequence[int]) -> Rounds:
    """Rounds of (child, parent) pairs covering each tree edge once.

    `parent[i]` is the parent of rank i, or -1 for the root (several roots make a forest). Trees are
    bipartite, so a greedy colouring from the roots down uses exactly the maximum degree: each node
    gives its children the colours its own parent edge does not use.
    """
    n = len(parent)
    par = [int(p) for p in parent]
    children: list[list[int]] = [[] for _ in range(n)]
    roots: list[int] = []
    for child, p in enumerate(par):
        if p == -1:
            roots.append(child)
        elif 0 <= p < n and p != child:
            children[p].append(child)
        else:
            raise ValueError(f"parent[{child}] = {p} is not a rank of this tree")
    if n and not roots:
        raise ValueError("a tree needs a root (parent -1)")

    colour_up = [-1] * n  # colour of the edge to the parent
    order = list(roots)
    seen = 0
    rounds: Rounds = []
    while seen < len(order):
        node = order[seen]
        seen += 1
        colour = 0
        for child in children[node]:
            if colour == colour_up[node]:
                colour += 1
            colour_up[child] = colour
            while len(rounds) <= colour:
                rounds.append([])
            rounds[colour].append((child, node))
            order.append(child)
            colour += 1
    if len(order) != n:
        raise ValueError("parent array has a cycle")
    return rounds


def binary_tree_parents(size: int) -> list[int]:
    """Parents of the heap-ordered binary tree over ranks 0..size-1 (root 0), NCCL-tree-like."""
    return [-1] + [(i - 1) // 2 for i in range(1, size)]
