"""The faults the demo plays, each as a newcomer should read it: the job it runs, the line it
writes into the fake's fault file, what the system should then name, and how to tell.

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
* ``grouped``: ``slow``'s slow GPU in a job whose DP communicator is used only inside groups
  (each iteration's DP step is one coalesced reduce-scatter of two buckets, Megatron's
  ``_coalescing_manager``). ncclGroupStart names no communicator, so the validator's targeted
  pause is taken right after the group that reaches its target: the rank is named and
  validated. (Stages whose DP communicators advance at different rates, with the validator's
  cut per communicator, are tests/native/test_never_harm.py's.)
* ``bench-peer-dies``: ``link``'s slow link in a job over two nodes (two agents), whose ranks
  report a 60 s process-group timeout (the workload models PyTorch's watchdog); once the
  validator's P2P checks begin, the agent of the second node is killed. The validation is
  abandoned, its transfers never held the job's communicators (they run on communicators split
  from them, aborted when they fail), the second node's ranks resume at their lease's end, a
  quarter of the timeout at most: the job keeps training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

FaultKind = Literal["slow", "link", "hang", "grouped", "bench-peer-dies"]
FAULT_KINDS: tuple[FaultKind, ...] = ("slow", "link", "hang", "grouped", "bench-peer-dies")
DEFAULT_FACTOR: dict[FaultKind, float] = {"slow": 1.5, "link": 4.0, "hang": 1.0, "grouped": 1.5,
                                          "bench-peer-dies": 4.0}
PG_TIMEOUT_S = 60.0  # the process-group timeout the new kinds' ranks report (PyTorch's default: 600)
HANG_AHEAD = 10  # iterations between the decision and the hung collective: the host runs ahead


@dataclass(frozen=True)
class DemoFault:
    kind: FaultKind
    rank: int  # the slow GPU, the hung rank, or the link's first end
    peer: int  # the link's other end (link only, else -1)
    factor: float
    job: dict[str, Any]  # FakeJobSpec fields besides job_id and iters
    second_node: tuple[int, ...] = ()  # ranks served by a second agent (bench-peer-dies)

    @property
    def validates(self) -> bool:
        """The fault is judged by the validation's outcome, not only by the localisation."""
        return self.kind != "hang"

    def line(self, at_seq: int = 0) -> str:
        """The fault-file line (``at_seq``: the hung collective's sequence number)."""
        if self.kind in ("slow", "grouped"):
            return f"slow_rank {self.rank} {self.factor:g}"
        if self.kind in ("link", "bench-peer-dies"):
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
        if self.kind == "grouped":
            return (f"rank {self.rank}'s GPU runs its kernels {self.factor:g}x slower, in a job "
                    f"whose DP communicator sees only coalesced reduce-scatters (a group of two "
                    f"an iteration)")
        if self.kind == "bench-peer-dies":
            return (f"the link between ranks {self.rank} and {self.peer} is {self.factor:g}x "
                    f"slower; ranks {list(self.second_node)} are on a second node, whose agent "
                    f"is killed once the validator's P2P checks begin; the ranks report a "
                    f"{self.job['pg_timeout_s']:g} s process-group timeout")
        return (f"rank {self.rank}'s all-reduce never completes on its GPU; every host call "
                f"still returns at once")

    def expects(self) -> str:
        if self.kind in ("slow", "grouped"):
            return f"compute_slow, GPU rank {self.rank}" + (
                ", validated after a pause at the groups' boundary" if self.kind == "grouped"
                else "")
        if self.kind == "link":
            return f"comm_slow, link {self.rank}-{self.peer}"
        if self.kind == "bench-peer-dies":
            return ("comm_slow localised, its validation abandoned, and the job training on "
                    "afterwards")
        return f"hang_hardware, rank {self.rank}"

    def names_culprit(self, culprit: dict[str, Any]) -> bool:
        """Whether an incident's culprit names this fault, and nothing else, as its cause."""
        if self.kind in ("slow", "grouped"):
            return list(culprit.get("compute_ranks") or culprit.get("ranks") or []) == [self.rank]
        if self.kind == "link":
            pairs = {tuple(sorted(p)) for p in culprit.get("link_ranks") or []}
            return pairs == {(min(self.rank, self.peer), max(self.rank, self.peer))}
        if self.kind == "bench-peer-dies":  # what the analyzer localised: the link's ends
            named = set(culprit.get("ranks") or []) | {
                r for p in culprit.get("link_ranks") or [] for r in p}
            return {self.rank, self.peer} <= named
        return list(culprit.get("ranks") or []) == [self.rank]

    def kind_ok(self, kind: str) -> bool:
        want = {"slow": ("compute_slow",), "link": ("comm_slow",), "hang": ("hang_hardware",),
                "grouped": ("compute_slow",), "bench-peer-dies": ("comm_slow", "mixed_slow")}
        return kind in want[self.kind]

    def outcome_ok(self, outcome: str | None) -> bool:
        """What the validation must have said: nothing amiss, or (bench-peer-dies) that it was
        abandoned."""
        if self.kind == "bench-peer-dies":
            return outcome is not None and outcome.startswith("abandoned")
        return outcome is None


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
    if kind in ("grouped", "bench-peer-dies") and (ranks < 4 or ranks % 2):
        raise ValueError(f"--fault {kind} needs an even number of ranks, at least 4, got {ranks}")
    if rank is None:
        rank = 1 if kind in ("link", "bench-peer-dies") else min(2, ranks - 1)
    if not 0 <= rank < ranks:
        raise ValueError(f"--rank must be in [0, {ranks}), got {rank}")
    factor = DEFAULT_FACTOR[kind] if factor is None else factor
    if kind != "hang" and factor <= 1.0:
        raise ValueError(f"--factor must be > 1, got {factor:g}")
    if kind in ("link", "bench-peer-dies"):
        # 20 ms of compute and a 32 MB all-reduce (~5 ms at the fake's 10 GB/s): the link's
        # factor stretches a fifth of the iteration.
        job: dict[str, Any] = {"world_size": ranks, "compute_ms": 20.0, "bytes": 32 << 20}
        if kind == "link":
            return DemoFault(kind, rank, (rank + 1) % ranks, factor, job)
        half = tuple(range(ranks // 2, ranks))  # the second node's ranks
        if (rank in half) == (((rank + 1) % ranks) in half):
            raise ValueError(f"--fault bench-peer-dies needs a link across the two nodes (ranks "
                             f"{ranks // 2 - 1} or {ranks - 1} as its first end), got {rank}")
        return DemoFault(kind, rank, (rank + 1) % ranks, factor,
                         {**job, "pg_timeout_s": PG_TIMEOUT_S}, second_node=half)
    if kind == "grouped":
        # every iteration's DP step: one group of two reduce-scatters (two buckets)
        return DemoFault(kind, rank, -1, factor, {
            "world_size": ranks, "compute_ms": 40.0, "dp_grouped": True, "dp_buckets": (2,),
            "pg_timeout_s": PG_TIMEOUT_S})
    return DemoFault(kind, rank, -1, factor, {"world_size": ranks, "compute_ms": 40.0})
