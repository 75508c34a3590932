"""Point-to-point hangs named by their pair, from each rank's oldest call pending on the GPU and
the peer it names (the comm table's gpu_pending_peer, layout 6).

A pipeline communicator's members are not compared member against member (each stage makes its
own calls), so ``diagnose_hang`` can only name all of its busy members. With the peer of every
pending send and receive, each one is checked against the other end:
  hang_inconsistent  both ends pending on each other with different sizes (CCL-D's H2 on a pair:
                     NCCL matches a send with the peer's receive in order and hangs, or corrupts,
                     when their sizes differ);
  hang_not_entered   one end pending, the other never posted its half (busy elsewhere or idle):
                     the absent end is named, with the pair;
  hang_hardware      both ends pending on each other with the same size: the pair is named.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from greyhound.core.arrays import FloatArray, IntArray
from greyhound.core.hang_diagnosis import HangDiagnosis
from greyhound.core.localize import Evidence

SEND, RECV = "send", "recv"


@dataclass(frozen=True, slots=True, eq=False)
class PendingP2p:
    """One element per (communicator, rank): its oldest call pending on the GPU (``op`` "none"
    when there is none), the peer that call names (its rank in the communicator, -1 unknown),
    its count, how long it has been pending, and the rank's own rank in the communicator."""

    comm_id: IntArray
    rank: IntArray
    comm_rank: IntArray
    op: NDArray[np.str_]
    peer: IntArray
    count: IntArray
    pending_s: FloatArray


def p2p_pair_hangs(p: PendingP2p, *, stall_s: float) -> list[HangDiagnosis]:
    """Every send or receive pending for ``stall_s`` or more, checked against its peer."""
    old = np.isin(p.op, (SEND, RECV)) & (p.peer >= 0) & (p.pending_s >= stall_s)
    out: list[HangDiagnosis] = []
    seen: set[tuple[int, int, int]] = set()
    for i in np.flatnonzero(old).tolist():
        comm = int(p.comm_id[i])
        members = np.flatnonzero(p.comm_id == comm)
        me, peer, op = int(p.comm_rank[i]), int(p.peer[i]), str(p.op[i])
        src, dst = (me, peer) if op == SEND else (peer, me)
        if (comm, src, dst) in seen:
            continue
        seen.add((comm, src, dst))
        other = members[p.comm_rank[members] == peer]
        rank_of = {int(p.comm_rank[j]): int(p.rank[j]) for j in members.tolist()}
        want = RECV if op == SEND else SEND
        ev: Evidence = {"comm_id": comm, "point_to_point": 1, "src": src, "dst": dst,
                        "src_rank": rank_of.get(src, -1), "dst_rank": rank_of.get(dst, -1),
                        "pending_s": float(p.pending_s[i])}
        counts = {op: int(p.count[i])}
        matched = False
        if len(other):
            j = int(other[0])
            matched = str(p.op[j]) == want and int(p.peer[j]) == me
            if matched:
                counts[want] = int(p.count[j])
            ev["peer_pending_op"] = str(p.op[j])
            ev["peer_pending_peer"] = int(p.peer[j])
        ev["send_count"] = counts.get(SEND, -1)
        ev["recv_count"] = counts.get(RECV, -1)
        pair = sorted(r for r in (rank_of.get(src, -1), rank_of.get(dst, -1)) if r >= 0)
        if not matched:
            absent = rank_of.get(peer, -1)
            ev["never_posted"] = want
            out.append(HangDiagnosis("hang_not_entered", comm, -1, want,
                                     [absent] if absent >= 0 else pair, ev))
        elif counts[SEND] != counts[RECV]:
            ev["size_mismatch"] = 1
            out.append(HangDiagnosis("hang_inconsistent", comm, -1, op, pair, ev))
        else:
            out.append(HangDiagnosis("hang_hardware", comm, -1, op, pair, ev))
    return out


def merge_pair_hangs(found: list[HangDiagnosis], pairs: list[HangDiagnosis]) -> list[HangDiagnosis]:
    """Pair diagnoses replace ``diagnose_hang``'s all-members one of the same pipeline
    communicator, and stand alone when nothing else was found (a lone pending send, whose peer
    is idle, stalls no collective)."""
    if not pairs:
        return found
    paired = {d.comm_id for d in pairs}
    kept = [d for d in found if not (d.evidence.get("point_to_point") and d.comm_id in paired)]
    replaced = len(kept) < len(found)
    if replaced or not kept:
        return kept + pairs
    return kept
