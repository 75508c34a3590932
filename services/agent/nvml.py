"""GPU health from NVML: clocks, throttle reasons, temperature, power, ECC, PCIe, NVLink, Xids.

The hook times what the GPU did; only the GPU itself can say why it was slow (held down by heat,
a power cap, a hardware slowdown) or why it stopped (an Xid). The agent asks NVML through pynvml
at a low rate and on demand, off the event loop (NVML calls block, a few ms each on a loaded
driver).

Nothing here may stop the agent: no library, no driver or a failed init leaves the sampler
closed (``available`` is False, logged once) and every sample empty; a call a GPU does not
support leaves that one field None, and the call is not made again for that GPU; any other
failure of a call costs that field of that sample. Each distinct failure is logged once.

``lib_path`` points pynvml at a library of our choosing (the fake NVML in tests and demos):
pynvml loads ``libnvidia-ml.so.1`` through the dynamic loader, and the loader's search path is
fixed when the process starts, so the library is loaded here and handed to pynvml instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import socket
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from services.agent.collector import Collector
from services.agent.visible_devices import (
    PciAddress,
    nvml_index,
    nvml_index_by_bus,
    pci_address,
    read_visible,
)
from services.common.bus.contract import MAX_GPUS, GpuHealth, GpuSample, Message, Subjects, XidEvent

with warnings.catch_warnings():  # the pynvml shim warns that nvidia-ml-py is the real package
    warnings.simplefilter("ignore")
    import pynvml

log = logging.getLogger(__name__)

T = TypeVar("T")

# nvmlClocksEventReason* bits (the throttle reasons), in NVML's order.
THROTTLE_REASONS: tuple[tuple[int, str], ...] = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal"),
    (0x40, "hw_thermal"),
    (0x80, "hw_power_brake"),
    (0x100, "display_clocks"),
    (0x200, "board_limit"),
    (0x400, "reliability"),
)
NVLINK_COUNTERS: tuple[tuple[int, str], ...] = (
    (0, "replay"), (1, "recovery"), (2, "crc_flit"), (3, "crc_data"))
MAX_NVLINKS = 18  # links per GPU on Hopper; NVML answers INVALID_ARGUMENT past the last one
EVENT_XID = 0x8  # nvmlEventTypeXidCriticalError
MAX_EVENTS_PER_POLL = 256
# A call this GPU cannot answer: not asked again for that GPU.
_NOT_THERE = {pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
              pynvml.NVML_ERROR_NO_PERMISSION}


def decode_throttle(mask: int) -> list[str]:
    """The names of a clock event reason bitmask's set bits; unknown bits as ``bit<k>``."""
    names = [name for bit, name in THROTTLE_REASONS if mask & bit]
    known = 0
    for bit, _ in THROTTLE_REASONS:
        known |= bit
    names += [f"bit{k}" for k in range(64) if mask & ~known & (1 << k)]
    return names


@dataclass
class _Gpu:
    index: int
    handle: Any
    uuid: str | None
    name: str | None
    missing: set[str]  # fields this GPU cannot report
    bus: PciAddress | None = None


class NvmlSampler:
    """One process-wide NVML session (pynvml's library state is global). Blocking: call its
    methods from a worker thread (``asyncio.to_thread``); a lock serialises them."""

    def __init__(self, lib_path: str | None = None, *, host: str = "",
                 xid_keep_s: float = 600.0, max_xids: int = 64) -> None:
        self.lib_path = lib_path
        self.host = host
        self.xid_keep_s = xid_keep_s
        self.gpus: dict[int, _Gpu] = {}
        self.xids: deque[tuple[int, XidEvent]] = deque(maxlen=max_xids)
        self.available = False
        self._opened = False
        self._events: Any = None
        self._lock = threading.Lock()
        self._logged: set[str] = set()

    # ---- life -------------------------------------------------------------------------------

    def open(self) -> bool:
        """Load and initialise NVML once; False (and a log line, once) when it is not there."""
        with self._lock:
            if self._opened:
                return self.available
            self._opened = True
            try:
                if self.lib_path:
                    self._load(self.lib_path)
                pynvml.nvmlInit()
            except Exception as exc:  # no library, no driver, a binding that does not fit
                log.warning("NVML not available (%s): no GPU health from this agent", exc)
                return False
            self.available = True
            try:
                count = pynvml.nvmlDeviceGetCount()
            except pynvml.NVMLError as exc:
                log.warning("NVML lists no GPUs (%s): no GPU health from this agent", exc)
                count = 0
            for i in range(count):
                self._attach(i)
            self._register_events()
            log.info("NVML: %d GPU(s)%s", len(self.gpus),
                     "" if self._events is not None else ", no Xid events")
            return True

    @staticmethod
    def _load(path: str) -> None:
        lib = ctypes.CDLL(path)
        with pynvml.libLoadLock:
            pynvml.nvmlLib = lib
            pynvml._nvmlGetFunctionPointer_cache.clear()

    def _attach(self, index: int) -> None:
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError as exc:
            self._once(f"handle{index}", "NVML: no handle for GPU %d (%s)", index, exc)
            return
        gpu = _Gpu(index, handle, None, None, set())
        gpu.uuid = self._call(gpu, "uuid", lambda: _text(pynvml.nvmlDeviceGetUUID(handle)))
        gpu.name = self._call(gpu, "name", lambda: _text(pynvml.nvmlDeviceGetName(handle)))
        bus = self._call(gpu, "pci", lambda: _text(pynvml.nvmlDeviceGetPciInfo(handle).busId))
        gpu.bus = pci_address(bus) if bus else None
        self.gpus[index] = gpu

    def uuids(self) -> dict[str, int]:
        """Each GPU's UUID -> its NVML index (GPUs whose UUID NVML did not give are left out)."""
        return {g.uuid: g.index for g in list(self.gpus.values()) if g.uuid}

    def buses(self) -> dict[PciAddress, int]:
        """Each GPU's PCI address -> its NVML index (those NVML gave no address for left out)."""
        return {g.bus: g.index for g in list(self.gpus.values()) if g.bus is not None}

    def _register_events(self) -> None:
        try:
            events = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            self._once("eventset", "NVML: no event set (%s): Xid events are not watched", exc)
            return
        registered = 0
        for gpu in self.gpus.values():
            try:
                pynvml.nvmlDeviceRegisterEvents(gpu.handle, EVENT_XID, events)
                registered += 1
            except pynvml.NVMLError as exc:
                self._once(f"events{gpu.index}", "NVML: GPU %d reports no Xid events (%s)",
                           gpu.index, exc)
        if registered:
            self._events = events
        else:
            pynvml.nvmlEventSetFree(events)

    def close(self) -> None:
        with self._lock:
            if not self.available:
                return
            self.available = False
            try:
                if self._events is not None:
                    pynvml.nvmlEventSetFree(self._events)
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as exc:
                log.warning("NVML shutdown: %s", exc)
            self._events = None
            self.gpus.clear()
            if self.lib_path:  # the next session in this process loads its own library again
                with pynvml.libLoadLock:
                    pynvml.nvmlLib = None
                    pynvml._nvmlGetFunctionPointer_cache.clear()

    # ---- reading ----------------------------------------------------------------------------

    def poll_xids(self) -> list[tuple[int, XidEvent]]:
        """The Xid events NVML queued since the last poll (a zero-timeout wait per event); they
        are also kept, for ``xid_keep_s``, to go with later samples of their GPU."""
        with self._lock:
            if not self.available or self._events is None:
                return []
            by_handle = {ctypes.addressof(g.handle.contents): g.index for g in self.gpus.values()}
            new: list[tuple[int, XidEvent]] = []
            for _ in range(MAX_EVENTS_PER_POLL):
                try:
                    data = pynvml.nvmlEventSetWait(self._events, 0)
                except pynvml.NVMLError as exc:
                    if exc.value != pynvml.NVML_ERROR_TIMEOUT:
                        self._once(f"wait{exc.value}", "NVML event wait: %s", exc)
                    break
                if not data.eventType & EVENT_XID:
                    continue
                index = by_handle.get(_address(data.device), -1)
                event = XidEvent(code=int(data.eventData), ts=time.time())
                log.warning("GPU %d on %s: Xid %d", index, self.host, event.code)
                new.append((index, event))
            self.xids.extend(new)
            return new

    def sample(self, indices: Iterable[int] | None = None) -> dict[int, GpuSample]:
        """One sample of each GPU in ``indices`` (default: all) that NVML knows; {} without
        NVML."""
        with self._lock:
            if not self.available:
                return {}
            wanted = self.gpus.keys() if indices is None else [i for i in indices if i in self.gpus]
            cutoff = time.time() - self.xid_keep_s
            out: dict[int, GpuSample] = {}
            for i in sorted(set(wanted)):
                xids = [e for g, e in self.xids if g == i and e.ts >= cutoff][-16:]
                out[i] = self._sample(self.gpus[i], xids)
            return out

    def _sample(self, gpu: _Gpu, xids: list[XidEvent]) -> GpuSample:
        h = gpu.handle
        mask = self._call(gpu, "throttle", lambda: _reasons(h))
        power = self._call(gpu, "power", lambda: pynvml.nvmlDeviceGetPowerUsage(h))
        links = self._call(gpu, "nvlink", lambda: _active_links(h))
        return GpuSample(
            index=gpu.index, host=self.host, uuid=gpu.uuid, name=gpu.name,
            sm_clock_mhz=self._call(gpu, "sm_clock", lambda: pynvml.nvmlDeviceGetClockInfo(
                h, pynvml.NVML_CLOCK_SM)),
            sm_clock_max_mhz=self._call(gpu, "sm_clock_max", lambda: pynvml.nvmlDeviceGetMaxClockInfo(
                h, pynvml.NVML_CLOCK_SM)),
            mem_clock_mhz=self._call(gpu, "mem_clock", lambda: pynvml.nvmlDeviceGetClockInfo(
                h, pynvml.NVML_CLOCK_MEM)),
            mem_clock_max_mhz=self._call(gpu, "mem_clock_max", lambda: pynvml.nvmlDeviceGetMaxClockInfo(
                h, pynvml.NVML_CLOCK_MEM)),
            throttle_mask=mask, throttle=decode_throttle(mask) if mask is not None else [],
            temperature_c=self._call(gpu, "temperature", lambda: pynvml.nvmlDeviceGetTemperature(
                h, pynvml.NVML_TEMPERATURE_GPU)),
            power_w=power / 1000.0 if power is not None else None,
            ecc_corrected=self._call(gpu, "ecc", lambda: pynvml.nvmlDeviceGetTotalEccErrors(
                h, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC)),
            ecc_uncorrected=self._call(gpu, "ecc", lambda: pynvml.nvmlDeviceGetTotalEccErrors(
                h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)),
            pcie_replays=self._call(gpu, "pcie_replays",
                                    lambda: pynvml.nvmlDeviceGetPcieReplayCounter(h)),
            nvlink_links=len(links) if links is not None else None,
            nvlink_errors=self._call(gpu, "nvlink_errors", lambda: _nvlink_errors(h, links))
            if links else None,
            xids=xids)

    def _call(self, gpu: _Gpu, field: str, fn: Callable[[], T]) -> T | None:
        """fn's value, or None when this GPU cannot give it (remembered) or the call failed."""
        if field in gpu.missing:
            return None
        try:
            return fn()
        except pynvml.NVMLError as exc:
            if exc.value in _NOT_THERE:
                gpu.missing.add(field)
                self._once(f"{field}:{exc.value}", "NVML: %s not available on GPU %d (%s); "
                           "left out of its samples", field, gpu.index, exc)
            else:
                self._once(f"{field}:{exc.value}", "NVML: reading %s of GPU %d failed: %s",
                           field, gpu.index, exc)
        except Exception as exc:  # a binding mismatch must cost a field, not the agent
            self._once(f"{field}:{type(exc).__name__}", "NVML: reading %s of GPU %d: %s: %s",
                       field, gpu.index, type(exc).__name__, exc)
        return None

    def _once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(msg, *args)


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _address(handle: Any) -> int:
    return ctypes.addressof(handle.contents) if handle else 0


def _reasons(handle: Any) -> int:
    """Current clock event reasons; the older name on drivers without the new call."""
    try:
        return int(pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
    except pynvml.NVMLError as exc:
        if exc.value != pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
            raise
        return int(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))


def _active_links(handle: Any) -> list[int]:
    """Indices of the active NVLinks; raises NOT_SUPPORTED on a GPU without NVLink."""
    active: list[int] = []
    for link in range(MAX_NVLINKS):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link):
                active.append(link)
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_INVALID_ARGUMENT or link > 0:
                break  # past the last link
            raise
    return active


def _nvlink_errors(handle: Any, links: list[int] | None) -> dict[str, int]:
    totals = {name: 0 for _, name in NVLINK_COUNTERS}
    for link in links or []:
        for counter, name in NVLINK_COUNTERS:
            totals[name] += int(pynvml.nvmlDeviceGetNvLinkErrorCounter(handle, link, counter))
    return totals


@dataclass
class JobGpu:
    """One GPU of a job on this node: its ranks, and since when (wall s) the earliest of them
    has run (the hook's anchor), so an Xid from before the job is not blamed on it."""

    ranks: list[int]
    since_s: float


def job_gpus(collector: Collector, ranks: Iterable[int] | None = None, *,
             host: str | None = None, uuids: Mapping[str, int] | None = None,
             buses: Mapping[PciAddress, int] | None = None,
             proc: Path = Path("/proc")) -> dict[int, JobGpu]:
    """NVML index -> the job's ranks on it: rings written on this ``host`` (default: this
    machine's name; the simulator's rings come from other hosts, whose GPUs are not ours), by
    their device field (-1, no GPU, is left out).

    The hook records the PCI bus id of the rank's device, which ``buses`` (NVML's) turns into the
    NVML index; without one, the CUDA device ordinal through the rank's CUDA_VISIBLE_DEVICES
    (read from its process, ``uuids`` resolving GPU UUIDs to NVML indices). See
    :mod:`services.agent.visible_devices`."""
    here = host if host is not None else socket.gethostname()
    wanted = None if ranks is None else set(ranks)
    out: dict[int, JobGpu] = {}
    for stream in collector.streams.values():
        if stream.ended or (wanted is not None and stream.rank not in wanted):
            continue
        header = stream.reader.header
        if header.device < 0 or not header.pci_bus_id:  # the hook learns them at a first call
            header = stream.reader.refresh_header()
        if header.device < 0 or header.host != here:
            continue
        index = nvml_index_by_bus(header.pci_bus_id, buses or {})
        if index is None:
            index = nvml_index(header.device, read_visible(header.pid, proc), uuids or {})
        if index is None:
            continue
        since = header.wall_anchor_ns / 1e9
        got = out.setdefault(index, JobGpu([], since))
        got.ranks.append(stream.rank)
        got.since_s = min(got.since_s, since)
    for g in out.values():
        g.ranks.sort()
    return dict(sorted(out.items()))


class GpuMonitor:
    """The agent's side of GPU health: a sample of each job's GPUs every ``sample_s`` seconds
    (and at once after an Xid), published per job, and answers to on-demand requests. Every
    NVML call runs in a worker thread."""

    def __init__(self, sampler: NvmlSampler, *, agent_id: str, sample_s: float = 5.0,
                 xid_poll_s: float = 1.0) -> None:
        self.sampler = sampler
        self.agent_id = agent_id
        self.sample_s = sample_s
        self.xid_poll_s = xid_poll_s
        self.published = 0

    async def open(self) -> bool:
        return await asyncio.to_thread(self.sampler.open)

    async def samples(self, collector: Collector, ranks: Iterable[int] | None = None
                      ) -> list[GpuSample]:
        """A fresh sample of the GPUs of ``collector``'s job (only those of ``ranks`` if given),
        each with the ranks on it; [] without NVML."""
        gpus = job_gpus(collector, ranks, uuids=self.sampler.uuids(), buses=self.sampler.buses())
        if not gpus or not self.sampler.available:
            return []
        await asyncio.to_thread(self.sampler.poll_xids)
        got = await asyncio.to_thread(self.sampler.sample, gpus)
        return [g.model_copy(update={
            "ranks": gpus[i].ranks[:256],
            "xids": [x for x in g.xids if x.ts >= gpus[i].since_s]}) for i, g in got.items()][:MAX_GPUS]

    async def collect(self, collectors: Mapping[str, Collector]) -> list[tuple[str, Message]]:
        """One GpuHealth per job with GPUs on this node: (subject, message) to publish."""
        out: list[tuple[str, Message]] = []
        for job, col in list(collectors.items()):
            gpus = await self.samples(col)
            if gpus:
                out.append((Subjects.gpu_health(job, self.agent_id), GpuHealth(
                    job_id=job, agent_id=self.agent_id, sampled_ns=time.time_ns(), gpus=gpus)))
        return out

    async def run(self, stop: asyncio.Event, collectors: Mapping[str, Collector],
                  emit: Callable[[str, Message], None]) -> None:
        """Sample and emit until ``stop``; Xids are polled every ``xid_poll_s`` and trigger a
        sample at once. Never raises: GPU health is a witness, not a reason to stop the agent."""
        if not await self.open():
            return
        next_sample = 0.0
        while not stop.is_set():
            try:
                xids = await asyncio.to_thread(self.sampler.poll_xids)
                if xids or time.monotonic() >= next_sample:
                    for subject, msg in await self.collect(collectors):
                        emit(subject, msg)
                        self.published += 1
                    next_sample = time.monotonic() + self.sample_s
            except Exception:
                log.exception("GPU health sampling failed; trying again in %.0fs", self.sample_s)
                next_sample = time.monotonic() + self.sample_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.xid_poll_s)
        await asyncio.to_thread(self.sampler.close)
