"""A rank's GPU health is its own GPU's, found by PCI bus id. Inside a container that exposes one
GPU (NVIDIA's runtime hides the others; CUDA_VISIBLE_DEVICES is unset) every rank is CUDA device
0, and under Slurm's ConstrainDevices CUDA_VISIBLE_DEVICES is renumbered from 0 inside the
cgroup: ordinals say nothing about which of the node's GPUs a rank has. The hook records the bus
id of the communicator's device, NVML reports every GPU's, and the agent matches the two."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from greyhound.fakejob import FakeJob, FakeJobSpec, FaultFile, native_build_dir
from services.agent import visible_devices as vd
from services.agent.collector import Collector
from services.agent.nvml import GpuMonitor, NvmlSampler, job_gpus
from tests.native.helpers import hook_lib, wait_for

PHYSICAL = {0: 6, 1: 3}  # rank -> the node's GPU its container exposes


@pytest.fixture()
def sampler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NvmlSampler]:
    monkeypatch.setenv("FAKE_NCCL_FAULTS", str(FaultFile(tmp_path / "nvml-faults.txt").path))
    monkeypatch.setenv("FAKE_NVML_GPUS", "8")
    s = NvmlSampler(str(native_build_dir() / "fake" / "libnvidia-ml.so.1"))
    assert s.open()
    yield s
    s.close()


def test_pci_addresses_compare_as_numbers() -> None:
    assert vd.pci_address("0000:3A:00.0") == vd.pci_address("00000000:3a:00.0") == (0, 0x3A, 0, 0)
    assert vd.pci_address("3b:00.1") == (0, 0x3B, 0, 1)
    assert vd.pci_address("") is None and vd.pci_address("GPU-1234") is None
    buses = {(0, 0x3A, 0, 0): 2}
    assert vd.nvml_index_by_bus("0000:3A:00.0", buses) == 2
    assert vd.nvml_index_by_bus("0000:3B:00.0", buses) is None
    assert vd.nvml_index_by_bus("", buses) is None


def test_nvml_lists_each_gpus_bus_id(sampler: NvmlSampler) -> None:
    buses = sampler.buses()
    assert len(buses) == 8 and sorted(buses.values()) == list(range(8))
    assert buses[(0, 0x3A, 0, 0)] == 2  # the fake node's layout (native/fake/fk_pci.h)


def test_a_recorded_bus_id_wins_over_the_ordinal(sampler: NvmlSampler) -> None:
    header = SimpleNamespace(device=0, host="h", pid=0, wall_anchor_ns=0, pci_bus_id="0000:3A:00.0")
    stream = SimpleNamespace(rank=4, ended=False, reader=SimpleNamespace(
        header=header, refresh_header=lambda: header))
    col = cast(Collector, SimpleNamespace(streams={0: stream}))
    buses = sampler.buses()
    got = job_gpus(col, host="h", uuids=sampler.uuids(), buses=buses)
    assert {i: g.ranks for i, g in got.items()} == {2: [4]}
    header.pci_bus_id = "0000:FF:00.0"  # a device NVML does not list: the ordinal, as before
    got = job_gpus(col, host="h", uuids=sampler.uuids(), buses=buses)
    assert {i: g.ranks for i, g in got.items()} == {0: [4]}


class _OneGpuContainers(FakeJob):
    """Each rank in a container of its own that exposes one of the node's GPUs: CUDA device 0,
    CUDA_VISIBLE_DEVICES unset (the fake CUDA's FAKE_CUDA_DEVICES plays the device cgroup)."""

    def rank_env(self, rank: int, build: Path) -> dict[str, str]:
        env = super().rank_env(rank, build)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        env.update(LOCAL_RANK="0", FAKE_CUDA_DEVICES=str(PHYSICAL[rank]))
        return env


def test_ranks_in_one_gpu_containers_get_their_own_gpus_health(sampler: NvmlSampler,
                                                                tmp_path: Path) -> None:
    build = native_build_dir()
    spec = FakeJobSpec(world_size=2, iters=300, compute_ms=5, compute_busy=0.0, job_id="cont",
                       verbose=False)
    shm = tmp_path / "shm"
    with _OneGpuContainers(spec, workdir=tmp_path / "w", hook=hook_lib(build), shm_dir=shm) as job:
        col = Collector(shm, "cont")

        def training() -> bool:  # the hook names the device at init, before the first call
            col.scan()
            calls = [int(s.reader.comms()["calls_entered"].sum()) for s in col.streams.values()]
            return len(calls) == 2 and min(calls) > 5

        wait_for(training, 30, "the job did not start")
        assert sorted(s.reader.refresh_header().device for s in col.streams.values()) == [0, 0]
        monitor = GpuMonitor(sampler, agent_id="a")
        got = asyncio.run(monitor.samples(col))
        assert [(g.index, g.ranks) for g in got] == [(3, [1]), (6, [0])]
        col.close()
        job.kill()
