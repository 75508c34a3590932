"""CCL-D's progress counters: rates over a window, where inside a collective a ring stopped, and
which link is slow, on rows built the way the hook's plugin counts a ring (each rank sends to the
next on every channel)."""

from __future__ import annotations

import numpy as np
import pytest

from greyhound.core.progress import (
    KERNEL,
    RECV,
    SEND,
    ProgressSample,
    inside_collective,
    slow_links,
    window_rates,
)

COMM = 77


def _ring(n: int = 4, channels: int = 2, done: dict[tuple[int, int, int], int] | None = None,
          posted: int = 48, stalled: float = 10.0, net_bw: dict[int, float] | None = None,
          kernels_open: tuple[int, ...] = ()) -> ProgressSample:
    """A ring of n ranks (global rank = 10 + comm rank) on ``channels`` channels: send rows
    (r -> r+1) and receive rows (r-1 -> r). ``done`` overrides steps done per (kind, rank,
    channel); a row below ``posted`` is stuck for ``stalled`` s."""
    done = done or {}
    net_bw = net_bw or {}
    cols: dict[str, list[float]] = {f: [] for f in ProgressSample.__slots__}
    for r in range(n):
        for ch in range(channels):
            for kind, peer in ((SEND, (r + 1) % n), (RECV, (r - 1) % n)):
                d = done.get((kind, r, ch), posted)
                row = dict(rank=10 + r, comm_id=COMM, comm_rank=r, kind=kind, channel=ch, peer=peer,
                           posted=posted, done=d, bytes=d * 1000, net_s=1.0,
                           stalled_s=stalled if d < posted else 0.1, seq=5, rate=100.0,
                           byte_rate=1e5, net_bw=net_bw.get(r, 1e9) if kind == SEND else 5e8)
                for k, v in row.items():
                    cols[k].append(v)
            kern = dict(rank=10 + r, comm_id=COMM, comm_rank=r, kind=KERNEL, channel=ch, peer=-1,
                        posted=3, done=2 if ch in kernels_open else 3, bytes=0, net_s=0.0,
                        stalled_s=stalled, seq=0, rate=0.0, byte_rate=0.0, net_bw=0.0)
            for k, v in kern.items():
                cols[k].append(v)
    return ProgressSample(**cols)


def _stalled_ring(stopping: int, channel: int, n: int = 4, half: int = 36) -> ProgressSample:
    """What a ring channel shows when ``stopping`` stops sending half-way (the fake NCCL's
    stop_channel): each later rank forwards one step more."""
    done = {}
    for r in range(n):
        d = (r - stopping) % n
        done[(SEND, r, channel)] = half + d
        done[(RECV, r, channel)] = half + (n - 1 if d == 0 else d - 1)
    return _ring(n, done=done, kernels_open=(channel,))


def test_window_rates_are_counts_over_time_and_network_bandwidth() -> None:
    rate, byte_rate, net_bw = window_rates(np.array([10, 5, 9]), np.array([30, 5, 4]),
                                           np.array([0, 0, 0]), np.array([4000, 0, 0]),
                                           np.array([0.0, 0.0, 0.0]), np.array([0.002, 0.0, 0.0]), 2.0)
    assert rate.tolist() == [10.0, 0.0, 0.0]  # a counter that went back (a reused slot) gives 0
    assert byte_rate.tolist() == [2000.0, 0.0, 0.0]
    assert net_bw[0] == pytest.approx(2e6) and net_bw[1] == 0.0
    assert not window_rates(np.array([1]), np.array([2]), np.array([0]), np.array([1]),
                            np.array([0.0]), np.array([1.0]), 0.0)[0].any()


@pytest.mark.parametrize("stopping", [0, 1, 3])
def test_the_link_out_of_the_rank_that_stopped_has_the_fewest_steps(stopping: int) -> None:
    inside = inside_collective(_stalled_ring(stopping, channel=1), COMM, stall_s=1.0)
    assert inside is not None
    assert inside.channels == [1] and inside.kernels_open == [1]
    (link,) = inside.links
    assert (link.channel, link.src, link.dst) == (1, stopping, (stopping + 1) % 4)
    assert link.sent == link.received == 36 and link.stopped == "sender"
    assert inside.first_comm_rank == stopping and inside.first_rank == 10 + stopping
    assert inside.evidence()["first_stopped_rank"] == 10 + stopping


def test_data_that_left_the_sender_and_never_arrived_blames_the_network_or_receiver() -> None:
    done = {(SEND, 2, 0): 40, (RECV, 3, 0): 30, (SEND, 3, 0): 31, (RECV, 0, 0): 31,
            (SEND, 0, 0): 32, (RECV, 1, 0): 32, (SEND, 1, 0): 33, (RECV, 2, 0): 33}
    inside = inside_collective(_ring(done=done), COMM, stall_s=1.0)
    assert inside is not None
    (link,) = inside.links
    assert (link.src, link.dst, link.sent, link.received) == (2, 3, 40, 30)
    assert link.stopped == "network_or_receiver"


def test_nothing_stuck_or_not_stuck_long_enough_is_no_finding() -> None:
    assert inside_collective(_ring(), COMM, stall_s=1.0) is None
    assert inside_collective(_stalled_ring(1, channel=0), COMM, stall_s=60.0) is None
    assert inside_collective(_stalled_ring(1, channel=0), COMM + 1, stall_s=1.0) is None


def test_channels_that_disagree_name_the_rank_most_of_them_name() -> None:
    a, b = _stalled_ring(2, channel=0), _stalled_ring(2, channel=1)
    merged = {f: np.where((a.channel == 0), getattr(a, f), getattr(b, f)) for f in ProgressSample.__slots__}
    inside = inside_collective(ProgressSample(**merged), COMM, stall_s=1.0)
    assert inside is not None and inside.channels == [0, 1] and inside.first_comm_rank == 2


def test_the_link_slow_on_the_network_is_named_though_every_link_runs_at_its_pace() -> None:
    s = _ring(net_bw={2: 2.5e8})  # rank 2 -> 3 at a quarter of the others' bandwidth
    (slow,) = slow_links(s)
    assert (slow.src, slow.dst, slow.src_rank, slow.dst_rank) == (2, 3, 12, 13)
    assert slow.channels == [0, 1] and slow.bandwidth / slow.others == pytest.approx(0.25)
    assert slow_links(_ring()) == []
    # receive rows wait for whatever feeds their sender: they never name a link
    s = _ring()
    s.net_bw[np.flatnonzero(s.kind == RECV)[3]] = 1e6
    assert slow_links(s) == []


def test_rows_must_have_equal_lengths() -> None:
    cols = {f: [0] for f in ProgressSample.__slots__}
    cols["rank"] = [0, 1]
    with pytest.raises(ValueError):
        ProgressSample(**cols)
