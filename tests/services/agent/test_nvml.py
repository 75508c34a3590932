"""The agent's NVML sampler against the fake NVML (native/fake/nvml.c, driven by the fault file):
every field, throttle decoding, Xid events, and NVML missing in its three ways (no library, no
driver, a call a GPU does not support), none of which may raise."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from greyhound.fakejob import FaultFile, native_build_dir
from services.agent.collector import Collector
from services.agent.nvml import GpuMonitor, NvmlSampler, decode_throttle
from services.agent.visible_devices import read_visible


def settle() -> None:
    """The fakes re-read a changed fault file within a few ms of the coarse clock."""
    time.sleep(0.03)


@pytest.fixture()
def fake_lib() -> str:
    return str(native_build_dir() / "fake" / "libnvidia-ml.so.1")


@pytest.fixture()
def faults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FaultFile:
    f = FaultFile(tmp_path / "faults.txt")
    monkeypatch.setenv("FAKE_NCCL_FAULTS", str(f.path))
    monkeypatch.setenv("FAKE_NVML_GPUS", "4")
    return f


@pytest.fixture()
def sampler(fake_lib: str, faults: FaultFile) -> Iterator[NvmlSampler]:
    s = NvmlSampler(fake_lib, host="node-2")
    yield s
    s.close()


def test_decode_throttle_names_every_bit() -> None:
    assert decode_throttle(0) == []
    assert decode_throttle(0x60) == ["sw_thermal", "hw_thermal"]
    assert decode_throttle(0x4 | 0x8) == ["sw_power_cap", "hw_slowdown"]
    assert decode_throttle(0x80 | (1 << 40)) == ["hw_power_brake", "bit40"]


def test_healthy_gpus_report_every_field(sampler: NvmlSampler) -> None:
    assert sampler.open()
    got = sampler.sample()
    assert sorted(got) == [0, 1, 2, 3]
    g = got[1]
    assert (g.index, g.host, g.name) == (1, "node-2", "Fake NVIDIA H100 80GB")
    assert g.uuid is not None and g.uuid.startswith("GPU-") and g.uuid != got[0].uuid
    assert (g.sm_clock_mhz, g.sm_clock_max_mhz) == (1980, 1980)
    assert (g.mem_clock_mhz, g.mem_clock_max_mhz) == (2619, 2619)
    assert (g.throttle_mask, g.throttle) == (0, [])
    assert g.temperature_c is not None and 40 <= g.temperature_c < 80
    assert g.power_w is not None and 400 <= g.power_w < 500
    assert (g.ecc_corrected, g.ecc_uncorrected, g.pcie_replays) == (0, 0, 0)
    assert g.nvlink_links == 4
    assert g.nvlink_errors == {"replay": 0, "recovery": 0, "crc_flit": 0, "crc_data": 0}
    assert g.xids == []
    assert sorted(sampler.sample([3, 1, 9])) == [1, 3]  # unknown indices are left out


def test_throttle_ecc_and_nvlink_faults_show(sampler: NvmlSampler, faults: FaultFile) -> None:
    assert sampler.open()
    faults.set("nvml_throttle 2 thermal")
    faults.set("nvml_throttle 0 power|hw")
    faults.set("nvml_ecc 3 5")
    faults.set("nvml_nvlink 3 7")
    settle()
    got = sampler.sample()
    assert got[2].throttle == ["sw_thermal", "hw_thermal"] and got[2].throttle_mask == 0x60
    assert got[2].sm_clock_mhz == 1095 and got[2].temperature_c == 87
    assert got[0].throttle == ["sw_power_cap", "hw_slowdown"]
    assert got[0].sm_clock_mhz is not None and got[0].sm_clock_mhz < 1980
    assert got[3].ecc_uncorrected == 5 and got[3].ecc_corrected == 0
    assert got[3].nvlink_errors is not None and got[3].nvlink_errors["crc_flit"] == 7
    assert got[1].throttle == [] and got[1].sm_clock_mhz == 1980
    faults.clear("nvml_throttle 2 thermal")
    faults.set("nvml_throttle 1 thermal|bogus")  # an unknown reason: the line is ignored
    settle()
    assert sampler.sample([2])[2].throttle == []
    assert sampler.sample([1])[1].throttle == []


def test_xid_events_are_polled_once_and_kept_with_samples(sampler: NvmlSampler,
                                                         faults: FaultFile) -> None:
    assert sampler.open()
    assert sampler.poll_xids() == []
    faults.set("nvml_xid 1 79")
    settle()
    new = sampler.poll_xids()
    assert [(i, e.code) for i, e in new] == [(1, 79)]
    assert sampler.poll_xids() == []  # delivered once
    got = sampler.sample()
    assert [x.code for x in got[1].xids] == [79]
    assert all(got[i].xids == [] for i in (0, 2, 3))
    faults.clear()
    settle()
    assert sampler.poll_xids() == []
    faults.set("nvml_xid 1 79")  # written again: a new event
    settle()
    assert [(i, e.code) for i, e in sampler.poll_xids()] == [(1, 79)]


def test_old_xids_age_out(fake_lib: str, faults: FaultFile) -> None:
    s = NvmlSampler(fake_lib, host="h", xid_keep_s=0.0)
    try:
        assert s.open()
        faults.set("nvml_xid 0 48")
        settle()
        assert len(s.poll_xids()) == 1
        assert s.sample([0])[0].xids == []
    finally:
        s.close()


def test_no_library_means_no_samples_and_no_crash(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    s = NvmlSampler(str(tmp_path / "libnvidia-ml.so.1"), host="h")
    with caplog.at_level(logging.WARNING, logger="services.agent.nvml"):
        assert not s.open()
        assert not s.open()  # tried once, logged once
    assert s.sample() == {} and s.poll_xids() == []
    s.close()
    assert sum("NVML not available" in r.getMessage() for r in caplog.records) == 1


def test_no_driver_means_no_samples(sampler: NvmlSampler, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_NVML_NO_DRIVER", "1")
    assert not sampler.open()
    assert sampler.sample() == {} and sampler.poll_xids() == []


def test_unsupported_calls_leave_their_fields_out(sampler: NvmlSampler,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("FAKE_NVML_UNSUPPORTED", "nvmlDeviceGetPowerUsage,nvmlDeviceGetTotalEccErrors,"
                       "nvmlDeviceRegisterEvents")
    monkeypatch.setenv("FAKE_NVML_NVLINKS", "0")
    with caplog.at_level(logging.WARNING, logger="services.agent.nvml"):
        assert sampler.open()
        for _ in range(3):
            got = sampler.sample()
    g = got[0]
    assert g.power_w is None and g.ecc_uncorrected is None and g.ecc_corrected is None
    assert g.nvlink_links is None and g.nvlink_errors is None
    assert g.sm_clock_mhz == 1980 and g.temperature_c is not None  # the rest is there
    assert sampler.poll_xids() == []  # no GPU takes Xid events: none watched
    power = [r for r in caplog.records if "power" in r.getMessage()]
    assert len(power) == 1, [r.getMessage() for r in power]  # once, not per GPU or sample


@dataclass
class _Stream:
    """What job_gpus reads of a rank's ring."""

    rank: int
    device: int
    anchor_s: float
    ended: bool = False
    host: str = socket.gethostname()
    pid: int = 0  # no process: the device ordinal is the NVML index
    bus: str = ""  # the PCI bus id the hook recorded ("": none, the ordinal maps)

    @property
    def reader(self) -> _Stream:
        return self

    @property
    def header(self) -> SimpleNamespace:
        return SimpleNamespace(device=self.device, host=self.host, pid=self.pid,
                               wall_anchor_ns=int(self.anchor_s * 1e9), pci_bus_id=self.bus)

    def refresh_header(self) -> SimpleNamespace:
        return self.header


def _collector(*streams: _Stream) -> Collector:
    return cast(Collector, SimpleNamespace(job="j", streams={i: s for i, s in enumerate(streams)}))


async def test_monitor_maps_gpus_to_ranks_and_blames_no_xid_from_before_the_job(
        sampler: NvmlSampler, faults: FaultFile) -> None:
    monitor = GpuMonitor(sampler, agent_id="a")
    assert await monitor.open()
    faults.set("nvml_xid 1 79")
    settle()
    now = time.time()
    old_job = _collector(_Stream(0, 1, now - 100), _Stream(1, 1, now - 50), _Stream(2, 3, now - 50),
                         _Stream(3, -1, now - 50), _Stream(4, 2, now - 50, ended=True),
                         _Stream(5, 4, now - 50, host="sim-node3"))  # a simulator's ring
    got = await monitor.samples(old_job)
    assert [(g.index, g.ranks, [x.code for x in g.xids]) for g in got] == [(1, [0, 1], [79]),
                                                                           (3, [2], [])]
    assert [g.index for g in await monitor.samples(old_job, ranks=[2])] == [3]
    # a job whose ranks started after the Xid was seen: not its GPU's fault
    new_job = _collector(_Stream(0, 1, time.time() + 1))
    assert [(g.index, g.xids) for g in await monitor.samples(new_job)] == [(1, [])]


def _until_exec_done(procs: list[subprocess.Popen[bytes]], timeout_s: float = 30.0) -> None:
    """Until every process's environment reads back. Popen returns once the child's exec has
    released the parent (vfork) and closed the error pipe, which the kernel does before it
    lays out the new image's environment: until then /proc/<pid>/environ reads empty, and a
    descheduled child on a busy machine was read as having no CUDA_VISIBLE_DEVICES (mapped
    to GPU 0). A rank process the agent reads has long been running."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        while read_visible(p.pid) is None:
            assert time.monotonic() < deadline, f"process {p.pid}'s environment never read back"
            time.sleep(0.01)


async def test_ranks_bound_to_one_gpu_each_are_mapped_through_their_visible_devices(
        sampler: NvmlSampler) -> None:
    """Under a scheduler that gives each rank one GPU, every rank is CUDA device 0: each rank's
    health is its own GPU's, found through the CUDA_VISIBLE_DEVICES of its process (an index, a
    UUID or a UUID prefix), never NVML GPU 0 for all."""
    monitor = GpuMonitor(sampler, agent_id="a")
    assert await monitor.open()
    uuid2 = next(u for u, i in sampler.uuids().items() if i == 2)
    env = [{"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": uuid2},
           {"CUDA_VISIBLE_DEVICES": "1,0"}, {"CUDA_VISIBLE_DEVICES": "MIG-2d0c1a7e"}]
    procs = [subprocess.Popen(["sleep", "30"], env={**os.environ, **e}) for e in env]
    try:
        _until_exec_done(procs)
        now = time.time()
        job = _collector(*(_Stream(r, 0, now - 10, pid=p.pid) for r, p in enumerate(procs)))
        got = await monitor.samples(job)
        # rank 3's MIG instance is not a GPU NVML samples: no health rather than GPU 0's
        assert [(g.index, g.ranks) for g in got] == [(1, [2]), (2, [1]), (3, [0])]
    finally:
        for p in procs:
            p.kill()
            p.wait()
