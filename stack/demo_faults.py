"""The three faults the demo plays, each as a newcomer should read it: the job it runs, the line
it writes into the fake's fault file, what the system should then name, and how to tell.

The fake NCCL/CUDA is asynchronous like a GPU (native/README.md): every NCCL call returns once
its work is enqueued, so each fault acts on the device and the host sees it only through its
per-iteration synchronisation.

* ``slow``: one rank's GPU runs its kernels ``factor`` x slower (``slow_rank``). Its GPU reaches
  every all-reduce late and its peers' all-reduces wait on their GPUs: a compute straggler, named
  by rank (the analyzer from the GPU timeline, the validator by a GEMM on each GPU).
* ``link``: the link between ranks a and a+1 is ``factor`` x slower (``slow_link``). The fake runs
  each collective as a ring over communicator-rank order, so two neighbours' link carries the
  all-reduce's traffic and sets its pace; large all-reduces (32 MB, a fifth of the iteration)
  make that show. The analyzer names the slow communicator; the validator's P2P rounds over its
  ring and tree links name the link, compared with the other links it tested. Neighbours in a
  ring of at least three: with two ranks, or a link off the ring, there is nothing to compare with
  or no traffic to slow.
* ``hang``: one rank's all-reduce at a chosen sequence number never completes on its GPU
  (``never_complete``). Every host call still returns; the hosts block later in their
  synchronisation, outside NCCL. The hang shows as a collective enqueued and not completed on
  the GPU (the hook's completion marks) past the tracker's hang threshold; CCL-D's rules name
  the rank whose GPU never finished (hang_hardware).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

FaultKind = Literal["slow", "link", "hang"]
FAULT_KINDS: tuple[FaultKind, ...] = ("slow", "link", "hang")
DEFAULT_FACTOR: dict[FaultKind, float] = {"slow": 1.5, "link": 4.0, "hang": 1.0}
HANG_AHEAD = 10  # iterations between the decision and the hung collective: the host runs ahead


@dataclass(frozen=True)
class DemoFault:
    kind: FaultKind
    rank: int  # the slow GPU, the hung rank, or the link's first end
    peer: int  # the link's other end (link only, else -1)
    factor: float
    job: dict[str, Any]  # FakeJobSpec fields besides job_id and iters

    def line(self, at_seq: int = 0) -> str:
        """The fault-file line (``at_seq``: the hung collective's sequence number)."""
        if self.kind == "slow":
            return f"slow_rank {self.rank} {self.factor:g}"
        if self.kind == "link":
            return f"slow_link {self.rank} {self.peer} {self.factor:g}"
        return f"never_complete {self.rank} {at_seq}"

    def injects(self) -> str:
        ranks = self.job["world_size"]
        if self.kind == "slow":
            return (f"rank {self.rank}'s GPU runs its kernels {self.factor:g}x slower; its host is "
                    f"untouched")
        if self.kind == "link":
            return (f"the link between ranks {self.rank} and {self.peer} is {self.factor:g}x "
                    f"slower; it carries the {ranks}-rank all-reduce ring's traffic "
                    f"{self.rank} -> {self.peer}")
        return (f"rank {self.rank}'s all-reduce never completes on its GPU; every host call "
                f"still returns at once")

    def expects(self) -> str:
        if self.kind == "slow":
            return f"compute_slow, GPU rank {self.rank}"
        if self.kind == "link":
            return f"comm_slow, link {self.rank}-{self.peer}"
        return f"hang_hardware, rank {self.rank}"

    def names_culprit(self, culprit: dict[str, Any]) -> bool:
        """Whether an incident's culprit names this fault, and nothing else, as its cause."""
        if self.kind == "slow":
            return list(culprit.get("compute_ranks") or culprit.get("ranks") or []) == [self.rank]
        if self.kind == "link":
            pairs = {tuple(sorted(p)) for p in culprit.get("link_ranks") or []}
            return pairs == {(min(self.rank, self.peer), max(self.rank, self.peer))}
        return list(culprit.get("ranks") or []) == [self.rank]

    def kind_ok(self, kind: str) -> bool:
        want = {"slow": ("compute_slow",), "link": ("comm_slow",), "hang": ("hang_hardware",)}
        return kind in want[self.kind]


def make_fault(kind: FaultKind, *, ranks: int = 4, rank: int | None = None,
               factor: float | None = None) -> DemoFault:
    """The demo's job and fault for one kind; ValueError with the reason for a bad choice."""
    if kind not in FAULT_KINDS:
        raise ValueError(f"--fault must be one of {', '.join(FAULT_KINDS)}, got {kind!r}")
    if kind == "link" and ranks < 3:
        raise ValueError("a slow link needs at least 3 ranks: its time is judged against the "
                         "other links of the ring")
    if ranks < 2:
        raise ValueError(f"--ranks must be at least 2, got {ranks}")
    if rank is None:
        rank = 1 if kind == "link" else min(2, ranks - 1)
    if not 0 <= rank < ranks:
        raise ValueError(f"--rank must be in [0, {ranks}), got {rank}")
    factor = DEFAULT_FACTOR[kind] if factor is None else factor
    if kind != "hang" and factor <= 1.0:
        raise ValueError(f"--factor must be > 1, got {factor:g}")
    if kind == "link":
        # 20 ms of compute and a 32 MB all-reduce (~5 ms at the fake's 10 GB/s): the link's
        # factor stretches a fifth of the iteration.
        return DemoFault(kind, rank, (rank + 1) % ranks, factor,
                         {"world_size": ranks, "compute_ms": 20.0, "bytes": 32 << 20})
    return DemoFault(kind, rank, -1, factor, {"world_size": ranks, "compute_ms": 40.0})
