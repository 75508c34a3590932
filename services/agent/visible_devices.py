"""Which NVML GPU a rank's CUDA device is.

The hook records the CUDA device ordinal the rank runs on. NVML numbers every GPU of the node;
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
from collections.abc import Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

VAR = b"CUDA_VISIBLE_DEVICES="
_warned: set[str] = set()


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
