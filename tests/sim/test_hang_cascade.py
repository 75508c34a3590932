"""A simulated hang spreads like a real one, and what the counters then show is enough for CCL-D's
diagnosis to name the kind and the rank."""

from __future__ import annotations

import numpy as np
import pytest

from greyhound.core.hang_diagnosis import CommCounters, LastRecords, diagnose_hang
from greyhound.sim.events import IterationTiming, Op
from greyhound.sim.hang_cascade import spread
from greyhound.sim.model import ClusterModel
from greyhound.sim.scenario import ScenarioError
from tests.sim.helpers import job, scenario

J = job(tp=2, dp=4, pp=4, gpus_per_node=4, microbatches=8, microbatch_compute_s=0.05,
        dp_allreduce_bytes=1e8, pp_activation_bytes=1e7, optimizer_s=0.01,
        link_latency_us=5.0, nvlink_latency_us=1.0)


def test_a_hang_reaches_only_the_ranks_that_wait_for_a_stuck_one() -> None:
    # Calls (instance: members): 0: ranks 0,1 | 1: ranks 1,2 | 2: ranks 3,4. Rank 0 never
    # enters call 0, so rank 1 waits there and never reaches call 1, where rank 2 then waits;
    # ranks 3 and 4 have nothing to do with them.
    rank = np.array([0, 1, 1, 2, 3, 4])
    inst = np.array([0, 0, 1, 1, 2, 2])
    enter = np.array([1.0, 1.0, 2.0, 2.0, 5.0, 5.0])
    absent = np.array([True, False, False, False, False, False])
    sp = spread(rank, inst, enter, 5, never_returns=np.zeros(6, bool), absent=absent)
    assert sp.reached.tolist() == [False, True, False, True, True, True]
    assert sp.stuck.tolist() == [False, True, False, True, False, False]
    assert sp.blocked_at[1] == 1.0 and sp.blocked_at[2] == 2.0
    assert np.isinf(sp.blocked_at[[3, 4]]).all()


def hung_iteration(kind: str, rank: int, start_s: float = 2.0, **more: str) -> IterationTiming:
    model = ClusterModel(scenario(J, [{"kind": kind, "rank": rank, "start_s": start_s, **more}]))
    t = 0.0
    while True:
        it = model.iteration(t)
        if it.hung:
            return it
        t = it.end_s


def agent_view(it: IterationTiming) -> tuple[CommCounters, LastRecords]:
    """What the counters say once the job is stuck, on the GPU timeline (which is how the
    analyzer reads the hook's completion marks): per (communicator, rank) the collectives its
    GPU reached and completed (a send or receive has no collective number, as in the hook),
    whether a call reached there is still pending, and that oldest pending call, or else the
    newest call reached. A GPU may have a send pending while a later receive completed."""
    ev = it.events()
    reached = np.isfinite(ev.gpu_start)
    stuck = reached & ~np.isfinite(ev.gpu_end)
    key = ev.comm * 100_000 + ev.rank
    cols: dict[str, list[object]] = {k: [] for k in
                                     ("comm", "rank", "ent", "comp", "seq", "op", "cnt", "en", "ex",
                                      "busy")}
    for k in np.unique(key):
        mine = np.flatnonzero(key == k)
        got = mine[reached[mine]]
        pending = got[stuck[got]]
        # no call reached in this iteration: the counters stand where the last iteration left them
        if len(pending):
            i = int(pending[np.argmin(ev.gpu_start[pending])])
        elif len(got):
            i = int(got[np.argmax(ev.seq[got])])
        else:
            i = int(mine[np.argmin(ev.seq[mine])])
        newest = int(ev.seq[got].max()) + 1 if len(got) else int(ev.seq[i])
        p2p = int(ev.op[i]) in (Op.SEND, Op.RECV)
        cols["comm"].append(int(k // 100_000))
        cols["rank"].append(int(k % 100_000))
        cols["busy"].append(bool(len(pending)))
        n = 0 if p2p else newest
        cols["ent"].append(n)
        cols["comp"].append(0 if p2p else int(ev.seq[i]) if len(pending) else n)
        cols["seq"].append(int(ev.seq[i]) if len(got) else n - 1)
        cols["op"].append(Op(int(ev.op[i])).name.lower())
        cols["cnt"].append(int(ev.count[i]))
        cols["en"].append(float(ev.gpu_start[i]) * 1e9 if len(got) else 0.0)
        cols["ex"].append(-1.0 if stuck[i] else 1.0)
    counters = CommCounters(cols["comm"], cols["rank"], cols["ent"], cols["comp"],
                            in_call=np.array(cols["busy"], dtype=bool))
    last = LastRecords(cols["comm"], cols["rank"], cols["seq"], np.array(cols["op"]),
                       cols["cnt"], np.full(len(cols["op"]), 9), cols["en"], cols["ex"])
    return counters, last


@pytest.mark.parametrize("kind", ["hang_not_entered", "hang_inconsistent", "hang_hardware"])
@pytest.mark.parametrize("victim", [5, 18, 30])
def test_counters_after_a_simulated_hang_name_its_kind_and_rank(kind: str, victim: int) -> None:
    it = hung_iteration(kind, victim)
    ev = it.events()
    mine = ev.rank == victim
    if kind == "hang_not_entered":  # the victim's GPU idles once its queued calls are done
        hung_at = float(ev.gpu_end[mine & np.isfinite(ev.gpu_end)].max(initial=it.start_s))
    else:
        hung_at = float(ev.gpu_start[mine & ~np.isfinite(ev.gpu_end)].min())
    # Not a global freeze: some other rank still completes a call it entered after that moment.
    later = ~mine & (ev.gpu_start > hung_at) & np.isfinite(ev.gpu_end)
    assert later.any()
    counters, last = agent_view(it)
    found = diagnose_hang(counters, last, now_ns=int(1e15))
    assert found, "no diagnosis"
    assert {d.kind for d in found} == {kind}
    assert all(d.ranks == [victim] for d in found)


def test_a_pipeline_call_that_never_returns_names_its_pipeline() -> None:
    """Rank 22's first call after 2.05 s is a receive. Its partner's send completed; every stage
    of that pipeline then waits inside a send or receive, and without kernel-level progress
    counters the diagnosis can narrow it to the pipeline communicator, not to one end."""
    counters, last = agent_view(hung_iteration("hang_hardware", 22, start_s=2.05))
    found = diagnose_hang(counters, last, now_ns=int(1e15))
    assert [d.kind for d in found] == ["hang_hardware"]
    d = found[0]
    assert d.op in ("send", "recv") and d.evidence["point_to_point"] == 1
    assert 22 in d.ranks and len(d.ranks) <= 4  # one rank per pipeline stage


@pytest.mark.parametrize(("call", "ops"), [("collective", {"allreduce", "allgather"}),
                                           ("p2p", {"send", "recv"})])
def test_a_scenario_can_say_which_call_a_hang_takes(call: str, ops: set[str]) -> None:
    """The same start as above, where the first call is a receive: a scenario that asks for a
    collective gets the victim's next collective, and the diagnosis names the rank alone (the
    e2e tests need that named rank whatever the iteration's phase at the fault's start)."""
    it = hung_iteration("hang_hardware", 22, start_s=2.05, call=call)
    ev = it.events()
    stuck = (ev.rank == 22) & ~np.isfinite(ev.gpu_end) & np.isfinite(ev.gpu_start)
    first = int(np.flatnonzero(stuck)[np.argmin(ev.gpu_start[stuck])])
    assert Op(int(ev.op[first])).name.lower() in ops
    found = diagnose_hang(*agent_view(it), now_ns=int(1e15))
    assert [d.kind for d in found] == ["hang_hardware"]
    if call == "collective":
        assert found[0].ranks == [22] and not found[0].evidence.get("point_to_point")
    else:
        assert 22 in found[0].ranks and found[0].evidence["point_to_point"] == 1


def test_only_a_hang_says_which_call_and_only_one_it_can_take() -> None:
    with pytest.raises(ScenarioError, match="call"):
        scenario(J, [{"kind": "hang_hardware", "rank": 1, "start_s": 1.0, "call": "kernel"}])
    with pytest.raises(ScenarioError, match="call"):
        scenario(J, [{"kind": "hang_inconsistent", "rank": 1, "start_s": 1.0, "call": "p2p"}])
    with pytest.raises(ScenarioError, match="call"):
        scenario(J, [{"kind": "gpu_slow", "rank": 1, "start_s": 1.0, "call": "collective"}])
