"""The hook as NCCL's profiler plugin, inside multi-process jobs over the fake NCCL (which loads it
as NCCL does: NCCL_PROFILER_PLUGIN, the version ladder, its own activation mask word): CCL-D's
step counters localise a hang inside a collective to the pair and channel whose counters
stopped, name the rank that stopped first when every rank is stuck, and name a slow network link
by its rates while the job trains on, never paused.

The counters are read the way the agent reads them (its Collector) and diagnosed the way the
analyzer does (its adapter over the pure cores)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from greyhound import hookabi as H
from greyhound.core.hang_diagnosis import HangDiagnosis
from greyhound.core.progress import RECV, SEND, ProgressSample, inside_collective, slow_links
from greyhound.fakejob import FakeJob, FakeJobSpec
from services.agent.collector import Collector
from services.analyzer.hangs import diagnose_from_rows
from tests.native.helpers import hook_lib, wait_for, wait_rings, world_entry

DEFAULT_MASK = int(H.ProfileClass.COLL | H.ProfileClass.P2P | H.ProfileClass.PROXY_OP
                   | H.ProfileClass.PROXY_STEP | H.ProfileClass.KERNEL_CH)


def _job(native_build: Path, tmp_path: Path, job_id: str, *, world: int = 4, per_node: int = 1,
         iters: int = 400, nbytes: int = 4 << 20, env: Mapping[str, str] | None = None) -> FakeJob:
    """A job whose ranks sit ``per_node`` to a node (transfers between nodes go through the
    network: proxy events), with the hook preloaded and named as the profiler plugin."""
    spec = FakeJobSpec(world_size=world, iters=iters, compute_ms=5, bytes=nbytes, job_id=job_id)
    hook = hook_lib(native_build)
    return FakeJob(spec, workdir=tmp_path / "w", hook=hook, shm_dir=tmp_path / "shm",
                   env={"NCCL_PROFILER_PLUGIN": str(hook), "FAKE_NCCL_RANKS_PER_NODE": str(per_node),
                        "FAKE_NCCL_LOG": str(tmp_path / "nccl.log"), **(env or {})})


def _sample(col: Collector) -> ProgressSample:
    return ProgressSample.from_columns(vars(col.progress(time.monotonic_ns())))


def _stall_at(readers: list[H.RingReader], ahead: int = 3) -> int:
    """A collective seq (0-based, as fault lines count) beyond every rank's newest."""
    return max(int(world_entry(r)["last_seq_entered"]) for r in readers) + ahead


def _stuck(readers: list[H.RingReader], seq: int) -> bool:
    """Every rank's collective ``seq`` (0-based) is pending on its GPU."""
    return all(int(world_entry(r)["gpu_pending_seq"]) == seq + 1 for r in readers)


def test_a_peer_that_stops_on_one_channel_is_localised_to_its_pair_and_channel(
        native_build: Path, tmp_path: Path) -> None:
    # two ranks per node: 1 -> 2 and 3 -> 0 cross the network, 0 -> 1 and 2 -> 3 do not
    with _job(native_build, tmp_path, "pairch", per_node=2) as job:
        readers = [H.RingReader(p) for p in wait_rings(tmp_path / "shm", "pairch", 4)]
        job.wait_iteration(3, 2, 60)
        seq = _stall_at(readers)
        job.faults.set(f"stop_channel 1 1 {seq}")
        wait_for(lambda: _stuck(readers, seq), 60, "every rank stuck in the collective")
        col = Collector(tmp_path / "shm", "pairch")
        col.scan()
        wait_for(lambda: inside_collective(_sample(col), H.signed64(int(world_entry(readers[0])[
            "comm_id"])), stall_s=1.0) is not None, 30, "steps stopped for a second")
        s = _sample(col)
        comm = int(s.comm_id[0])
        inside = inside_collective(s, comm, stall_s=1.0)
        assert inside is not None and inside.channels == [1] and inside.kernels_open == [1]
        (link,) = inside.links
        assert (link.channel, link.src_rank, link.dst_rank, link.stopped) == (1, 1, 2, "sender")
        assert link.sent == link.received < link.posted
        assert inside.first_rank == 1
        assert inside.seq == seq + 1  # the comm table's (and the records') numbering
        slots = readers[1].progress()["slots"]
        used = slots[slots["key"] != 0]
        assert set(used["op"].tolist()) == {int(H.Op.ALLREDUCE)}  # named from NCCL's "AllReduce"
        # intra-node transfers have no step counters (NCCL raises no proxy events for them)
        sends = s.kind == SEND
        assert sorted(zip(s.rank[sends].tolist(), s.peer[sends].tolist(), strict=True)) == \
            [(1, 2)] * 2 + [(3, 0)] * 2
        # the other channel finished its share: nothing of it is stuck
        other = (s.channel == 0) & (s.kind != 2)
        assert np.all(s.done[other] == s.posted[other])
        done_before = job.iterations(0)[-1].it
        job.faults.clear()
        job.wait_iteration(0, done_before + 3, 60)  # the stall let go: the job trains on
        col.close()
        job.kill()


def test_an_h3_hang_where_every_rank_is_stuck_names_the_rank_that_stopped_first(
        native_build: Path, tmp_path: Path) -> None:
    with _job(native_build, tmp_path, "firststop") as job:
        readers = [H.RingReader(p) for p in wait_rings(tmp_path / "shm", "firststop", 4)]
        job.wait_iteration(3, 2, 60)
        seq = _stall_at(readers)
        job.faults.set(f"stop_channel 2 -1 {seq}")  # rank 2's GPU stops feeding every channel
        wait_for(lambda: _stuck(readers, seq), 60, "every rank stuck in the collective")
        col = Collector(tmp_path / "shm", "firststop")
        col.scan()

        def diagnose(with_progress: bool) -> list[HangDiagnosis]:
            now = time.monotonic_ns()
            rows, prog = vars(col.counters(now)), vars(col.progress(now))
            return diagnose_from_rows(rows, now_ns=time.time_ns(), stalled_s=3.0,
                                      progress=prog if with_progress else None)

        def named_first() -> bool:
            found = diagnose(True)
            return len(found) == 1 and found[0].ranks == [2]

        wait_for(named_first, 60, "the diagnosis names the rank that stopped first")
        (d,) = diagnose(True)
        assert d.kind == "hang_hardware" and d.ranks == [2]
        assert d.evidence["localized_by"] == "progress"
        assert d.evidence["all_pending_ranks"] == [0, 1, 2, 3]
        assert d.evidence["inside_channels"] == [0, 1]
        links = d.evidence["inside_links"]
        assert isinstance(links, list) and len(links) == 2
        assert all(isinstance(x, dict) and (x["src_rank"], x["dst_rank"]) == (2, 3) for x in links)
        # the comm table alone: every rank entered the collective and none finished it
        (d,) = diagnose(False)
        assert d.kind == "hang_hardware" and d.ranks == [0, 1, 2, 3] and d.evidence["localized"] == 0
        col.close()
        job.kill()


def test_a_slow_network_link_is_named_by_its_rates_while_the_job_trains_unpaused(
        native_build: Path, tmp_path: Path) -> None:
    env = {"FAKE_NCCL_BW_GBPS": "1"}  # 4 MiB all-reduces take milliseconds: steps are timed
    with _job(native_build, tmp_path, "slowlink", env=env) as job:
        readers = [H.RingReader(p) for p in wait_rings(tmp_path / "shm", "slowlink", 4)]
        job.wait_iteration(3, 2, 60)
        job.faults.set("slow_link 2 3 4")
        col = Collector(tmp_path / "shm", "slowlink")
        col.scan()
        time.sleep(1.0)
        _sample(col)  # the window starts
        it0 = min(job.iterations(r)[-1].it for r in range(4))
        time.sleep(3.0)
        s = _sample(col)
        it1 = min(job.iterations(r)[-1].it for r in range(4))
        (slow,) = slow_links(s)
        assert (slow.src_rank, slow.dst_rank, slow.channels) == (2, 3, [0, 1])
        assert slow.bandwidth < 0.5 * slow.others
        # every link runs at the slow one's pace: the step rates cannot tell (CCL-D's SendRate)
        sends = (s.kind == SEND) & (s.rate > 0)
        assert float(s.rate[sends].max()) < 1.5 * float(s.rate[sends].min())
        assert (s.kind == RECV).any()
        # trained meanwhile, never paused, never switched to profile mode
        assert it1 >= it0 + 3
        for r in readers:
            ctl = r.control_block()
            assert int(ctl["pause_count"]) == 0 and int(ctl["mode"]) == H.Mode.MONITOR
        col.close()
        job.kill()


@pytest.mark.parametrize(("newest", "taken"), [(6, 6), (5, 5), (4, 4), (3, 3), (2, 0)])
def test_nccl_takes_the_newest_interface_it_knows_and_runs_without_the_plugin_otherwise(
        native_build: Path, tmp_path: Path, newest: int, taken: int) -> None:
    """The fake plays NCCL 2.29+ (v6), 2.28 (v5), 2.27 (v4), 2.26 (v3) and 2.23-2.25 (v1, v2,
    which the hook does not provide: NCCL runs without it)."""
    with _job(native_build, tmp_path, f"ladder{newest}", world=2, iters=8,
              env={"FAKE_NCCL_PROFILER_MAX": str(newest)}) as job:
        readers = [H.RingReader(p) for p in wait_rings(tmp_path / "shm", f"ladder{newest}", 2)]
        assert job.wait(60) == [0, 0]
    g = readers[0].progress()
    assert int(g["plugin_version"]) == taken
    events = g["events"]
    if taken == 0:
        assert not events.any()
        assert "no version this NCCL supports" in (tmp_path / "nccl.log").read_text()
        return
    bit = {c: int(c).bit_length() - 1 for c in H.ProfileClass}
    assert events[bit[H.ProfileClass.COLL]] >= 8 and events[bit[H.ProfileClass.PROXY_STEP]] > 0
    assert events[bit[H.ProfileClass.KERNEL_CH]] >= 16 and int(g["unbound"]) == 0
    assert (events[bit[H.ProfileClass.COLL_API]] > 0) == (taken >= 5)  # API events: 2.28+


@pytest.mark.parametrize("plugin", ["none", "libcublas.so.12", "missing"])
def test_no_plugin_or_a_library_without_one_leaves_nccl_running(
        native_build: Path, tmp_path: Path, plugin: str) -> None:
    with _job(native_build, tmp_path, "noplug", world=2, iters=5,
              env={"NCCL_PROFILER_PLUGIN": plugin}) as job:
        readers = [H.RingReader(p) for p in wait_rings(tmp_path / "shm", "noplug", 2)]
        assert job.wait(60) == [0, 0]
    assert int(readers[0].progress()["plugin_version"]) == 0


def test_an_init_that_fails_leaves_nccl_running_without_the_plugin(
        native_build: Path, tmp_path: Path) -> None:
    """A job with recording disabled (no ring to count into) gets NCCL's init refused."""
    with _job(native_build, tmp_path, "offplug", world=2, iters=5,
              env={"GREYHOUND_HOOK_DISABLE": "1"}) as job:
        assert job.wait(60) == [0, 0]
    assert "profiler plugin init failed" in (tmp_path / "nccl.log").read_text()
    assert not (tmp_path / "shm" / "offplug").exists() or not list((tmp_path / "shm" / "offplug").iterdir())


def test_the_costly_classes_come_on_while_the_rank_is_profiled_or_asked_for(
        native_build: Path, tmp_path: Path) -> None:
    with _job(native_build, tmp_path, "mask", world=2, iters=4000, nbytes=1 << 16) as job:
        (reader, _) = [H.RingReader(p) for p in wait_rings(tmp_path / "shm", "mask", 2)]
        job.wait_iteration(0, 2, 60)
        launch = int(H.ProfileClass.KERNEL_LAUNCH).bit_length() - 1
        assert int(reader.progress()["mask_applied"]) == DEFAULT_MASK
        assert int(reader.progress()["events"][launch]) == 0
        ctl = reader.control()
        ctl.set_mode("profile")
        wait_for(lambda: int(reader.progress()["mask_applied"]) & int(H.ProfileClass.KERNEL_LAUNCH) != 0,
                 30, "profile mode switched the costly classes on")
        wait_for(lambda: int(reader.progress()["events"][launch]) > 0, 30, "kernel launch events")
        ctl.set_mode("monitor")
        wait_for(lambda: int(reader.progress()["mask_applied"]) == DEFAULT_MASK, 30, "back to default")
        extra = int(H.ProfileClass.PROXY_CTRL)
        reader.want_classes(extra)
        wait_for(lambda: int(reader.progress()["mask_applied"]) == DEFAULT_MASK | extra, 30,
                 "the agent's extra class applied")
        job.kill()
