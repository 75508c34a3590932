"""Pipeline hangs named by their pair: each rank's oldest pending send or receive against what
its peer is pending on (the comm table's gpu_pending_peer)."""

from __future__ import annotations

import numpy as np

from greyhound.core.hang_diagnosis import HangDiagnosis
from greyhound.core.p2p_hangs import PendingP2p, merge_pair_hangs, p2p_pair_hangs

COMM = 5


def _pending(rows: list[tuple[int, str, int, int, float]]) -> PendingP2p:
    """(comm rank, op, peer, count, pending_s) per rank of one pipeline communicator; global rank
    = 100 + comm rank."""
    return PendingP2p(comm_id=np.full(len(rows), COMM), rank=np.array([100 + r[0] for r in rows]),
                      comm_rank=np.array([r[0] for r in rows]), op=np.array([r[1] for r in rows]),
                      peer=np.array([r[2] for r in rows]), count=np.array([r[3] for r in rows]),
                      pending_s=np.array([r[4] for r in rows]))


def test_a_pair_that_disagrees_on_the_size_is_h2_named_by_the_pair() -> None:
    (d,) = p2p_pair_hangs(_pending([(0, "send", 1, 1024, 30.0), (1, "recv", 0, 1025, 30.0)]),
                          stall_s=5.0)
    assert d.kind == "hang_inconsistent" and d.ranks == [100, 101]
    assert d.evidence["size_mismatch"] == 1
    assert (d.evidence["send_count"], d.evidence["recv_count"]) == (1024, 1025)
    assert (d.evidence["src_rank"], d.evidence["dst_rank"]) == (100, 101)


def test_a_send_whose_receive_was_never_posted_names_the_absent_end_and_the_pair() -> None:
    (d,) = p2p_pair_hangs(_pending([(0, "send", 1, 64, 30.0), (1, "none", -1, 0, 0.0)]),
                          stall_s=5.0)
    assert d.kind == "hang_not_entered" and d.ranks == [101] and d.op == "recv"
    assert (d.evidence["src"], d.evidence["dst"], d.evidence["never_posted"]) == (0, 1, "recv")
    # the receiver waits on someone else: still not the send's half
    (d,) = p2p_pair_hangs(_pending([(0, "send", 1, 64, 30.0), (1, "recv", 2, 64, 30.0),
                                    (2, "none", -1, 0, 0.0)]), stall_s=5.0)[:1]
    assert d.kind == "hang_not_entered" and d.ranks == [101]


def test_a_receive_never_sent_to_names_the_sender() -> None:
    (d,) = p2p_pair_hangs(_pending([(0, "none", -1, 0, 0.0), (1, "recv", 0, 64, 30.0)]),
                          stall_s=5.0)
    assert d.kind == "hang_not_entered" and d.ranks == [100] and d.op == "send"


def test_both_ends_pending_on_each_other_alike_name_the_pair_once() -> None:
    (d,) = p2p_pair_hangs(_pending([(0, "send", 1, 64, 30.0), (1, "recv", 0, 64, 30.0)]),
                          stall_s=5.0)
    assert d.kind == "hang_hardware" and d.ranks == [100, 101]


def test_young_waits_and_collectives_are_left_alone() -> None:
    assert p2p_pair_hangs(_pending([(0, "send", 1, 64, 1.0), (1, "none", -1, 0, 0.0)]),
                          stall_s=5.0) == []
    assert p2p_pair_hangs(_pending([(0, "allreduce", -1, 64, 30.0), (1, "send", -1, 1, 30.0)]),
                          stall_s=5.0) == []


def test_pairs_replace_the_all_members_diagnosis_of_their_communicator() -> None:
    allp = HangDiagnosis("hang_hardware", COMM, 3, "send", [100, 101, 102], {"point_to_point": 1})
    other = HangDiagnosis("hang_not_entered", 9, 3, "allreduce", [7], {})
    pair = HangDiagnosis("hang_inconsistent", COMM, -1, "send", [100, 101], {})
    assert merge_pair_hangs([allp, other], [pair]) == [other, pair]
    assert merge_pair_hangs([], [pair]) == [pair]
    # a collective's root cause stands; an unrelated pair adds nothing
    assert merge_pair_hangs([other], [pair]) == [other]
    assert merge_pair_hangs([other], []) == [other]
