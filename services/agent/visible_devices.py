"""Which NVML GPU a rank's CUDA device is.

First by PCI bus id: the hook records the bus id of the communicator's device
(``cudaDeviceGetPCIBusId``, or the driver's ``cuDeviceGetPCIBusId``), and NVML reports every GPU's;
the address is the GPU's, whatever the process sees, so it holds inside containers that expose
one GPU as device 0 (with ``CUDA_VISIBLE_DEVICES`` unset) and under Slurm's ConstrainDevices
(which renumbers ``CUDA_VISIBLE_DEVICES`` from 0 inside the cgroup). CUDA writes the domain with
four digits, NVML with eight: addresses are compared as numbers (:func:`pci_address`).

Without one (an older hook, a device it could not ask), the ordinal: the hook records the CUDA
device ordinal the rank runs on. NVML numbers every GPU of the node;
CUDA numbers only those ``CUDA_VISIBLE_DEVICES`` lets the process see, in the order it lists them.
Under a scheduler that binds one GPU per task (Slurm's ``--gpus-per-task``, Kubernetes device
plugins) every rank is device 0 while each runs on a different GPU, so the ordinal alone would
pin every rank's health on NVML GPU 0. The agent reads the rank's ``CUDA_VISIBLE_DEVICES`` from
``/proc/<pid>/environ`` (same node; the agent must see the job's processes: the same PID
namespace and the right to read their environment, which ``hostPID`` and root give) and maps the
ordinal through it: an index is an NVML index; ``GPU-<uuid>`` (or a unique prefix of one, as CUDA
accepts) is found by UUID. A MIG instance, a name NVML does not know or an ordinal past the list
maps to no GPU: no health is better than another GPU's. Unset or unreadable: the ordinal is
taken as the NVML index, which holds when CUDA and NVML enumerate alike (the same model of GPU
throughout the node, or ``CUDA_DEVICE_ORDER=PCI_BUS_ID``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

VAR = b"CUDA_VISIBLE_DEVICES="
_warned: set[str] = set()
_PCI = re.compile(r"^\s*(?:([0-9A-Fa-f]{1,8}):)?([0-9A-Fa-f]{1,2}):([0-9A-Fa-f]{1,2})\.([0-7])\s*$")

PciAddress = tuple[int, int, int, int]  # domain, bus, device, function


def pci_address(text: str) -> PciAddress | None:
    """``0000:3B:00.0`` (CUDA), ``00000000:3B:00.0`` (NVML) or ``3b:00.0`` as numbers; None for
    anything else."""
    m = _PCI.match(text)
    if m is None:
        return None
    domain, bus, dev, fn = m.groups()
    return int(domain or "0", 16), int(bus, 16), int(dev, 16), int(fn)


def nvml_index_by_bus(bus_id: str, buses: Mapping[PciAddress, int]) -> int | None:
    """The NVML index of the GPU at PCI address ``bus_id`` (as the hook recorded it), None when
    it names no GPU NVML lists (or is empty)."""
    addr = pci_address(bus_id) if bus_id else None
    return buses.get(addr) if addr is not None else None


def read_visible(pid: int, proc: Path = Path("/proc")) -> list[str] | None:
    """The entries of process ``pid``'s ``CUDA_VISIBLE_DEVICES``; None when it is unset or the
    environment cannot be read (no such process here, no permission)."""
    if pid <= 0:
        return None
    try:
        env = (proc / str(pid) / "environ").read_bytes()
    except PermissionError:
        if "permission" not in _warned:
            _warned.add("permission")
            log.warning("cannot read the environment of rank process %d: GPU health is mapped by "
                        "CUDA device ordinal, as if CUDA_VISIBLE_DEVICES were unset (give the agent "
                        "the job's user, or CAP_SYS_PTRACE)", pid)
        return None
    except OSError:
        return None
    for entry in env.split(b"\0"):
        if entry.startswith(VAR):
            value = entry[len(VAR):].decode("utf-8", "replace")
            return [v.strip() for v in value.split(",")]
    return None


def nvml_index(ordinal: int, visible: Sequence[str] | None, uuids: Mapping[str, int]) -> int | None:
    """The NVML index of CUDA device ``ordinal`` under ``visible`` (see the module docstring);
    ``uuids`` maps each NVML GPU's UUID to its index."""
    if ordinal < 0:
        return None
    if visible is None:
        return ordinal
    # CUDA stops at the first entry it cannot parse; what follows is not visible.
    seen: list[int] = []
    for entry in visible:
        index = _entry_index(entry, uuids)
        if index is None:
            break
        seen.append(index)
    return seen[ordinal] if ordinal < len(seen) else None


def _entry_index(entry: str, uuids: Mapping[str, int]) -> int | None:
    if entry.isdigit():
        return int(entry)
    if entry.startswith("GPU-"):
        found = [i for u, i in uuids.items() if u.startswith(entry)]
        return found[0] if len(found) == 1 else None
    return None
