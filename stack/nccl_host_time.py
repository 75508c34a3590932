"""How long the training hosts spent inside intercepted NCCL calls, from the hook's own records.

On a GPU (and on the asynchronous fake) an NCCL call only enqueues its work and returns within
microseconds; the collective runs later on the GPU. The demo shows that figure next to the GPU
times to make the point that host time inside NCCL says nothing about a straggler or a hang,
and that the incident is found anyway, from the GPU timeline.

Read-only: the records are peeked at in the ring files, the agent's consumed cursor is never
touched (the agent is the rings' single consumer). Records the hook has since overwritten (the
ring wrapped) are simply not there; a slot whose stamp does not match its index is skipped.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from greyhound.hookabi import COLLECTIVE_OPS, P2P_OPS, RECORD_DTYPE, Op, list_rings
from greyhound.hookabi.mapping import RingMapping

# The calls a training step makes on its data path: what a host would be "inside" while its
# GPU communicates. Communicator set-up, teardown and error polls are left out.
DATA_PATH_OPS: tuple[int, ...] = (*(int(o) for o in COLLECTIVE_OPS), *(int(o) for o in P2P_OPS),
                                  int(Op.GROUP_START), int(Op.GROUP_END))


def data_path_records(path: Path) -> np.ndarray:
    """The data-path records still held in one ring (oldest first)."""
    ring = RingMapping(path)
    try:
        head = int(ring.hdr["head"])
        first = max(0, head - ring.capacity)
        if head <= first:
            return np.empty(0, RECORD_DTYPE)
        rec = ring.slice_copy(first, head - first)
    finally:
        ring.close()
    complete = rec["stamp"] == np.arange(first + 1, head + 1, dtype=np.uint64)
    out: np.ndarray = rec[complete & np.isin(rec["op"], DATA_PATH_OPS)]
    return out


def host_ns_in_nccl(shm_dir: Path, job: str) -> np.ndarray:
    """return_ns - enter_ns of every data-path record of the job's rings, all ranks together."""
    parts = [data_path_records(p) for p in list_rings(shm_dir, job)]
    rec = np.concatenate(parts) if parts else np.empty(0, RECORD_DTYPE)
    ok = rec["return_ns"] >= rec["enter_ns"]
    out: np.ndarray = (rec["return_ns"][ok] - rec["enter_ns"][ok]).astype(np.int64)
    return out
