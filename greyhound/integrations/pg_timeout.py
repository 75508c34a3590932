"""Tell the Greyhound hook the job's collective timeout, so that no validation pause can trip it.

PyTorch's ProcessGroupNCCL stamps each collective's work object before the NCCL call, and its
watchdog aborts the communicator (with TORCH_NCCL_ASYNC_ERROR_HANDLING, the default, the whole
process) once the process group's timeout passes before the GPU completes the work. A
validation parks the rank inside such a call, so the pause counts toward that timeout. The hook
ends any pause at a quarter of the timeout the rank reports, and the validator plans within it;
a rank that reports none is held at most for the validator's budget (20 s by default) and the
hook's lease.

Use, in each training process, once the process group exists::

    import torch.distributed as dist
    from greyhound.integrations.pg_timeout import process_group_timeout, report_pg_timeout

    dist.init_process_group("nccl", timeout=timedelta(minutes=5))
    report_pg_timeout(process_group_timeout())      # or report_pg_timeout(timedelta(minutes=5))

It sets ``GREYHOUND_PG_TIMEOUT_S`` (read by the hook when it makes its ring and at every pause)
and, when this process's ring exists already (NCCL communicators made eagerly), writes the
timeout into its control block, where the agent reads it for the validator. Nothing here
imports torch unless :func:`process_group_timeout` is called.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from greyhound import hookabi as H

ENV = "GREYHOUND_PG_TIMEOUT_S"
_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")  # as the hook reads them


def own_ring(environ: dict[str, str] | None = None) -> Path | None:
    """This process's ring file, where the hook puts it (None without a rank to name it)."""
    env = os.environ if environ is None else environ
    rank = next((env[v] for v in _RANK_VARS if env.get(v, "").isdigit()), None)
    if rank is None:
        return None
    return H.ring_path(Path(env.get("GREYHOUND_SHM_DIR") or "/dev/shm/greyhound"),
                       env.get("GREYHOUND_JOB_ID") or "default", int(rank))


def report_pg_timeout(timeout: float | timedelta, *, ring: Path | None = None) -> bool:
    """Report the job's collective timeout (seconds, or a timedelta) to the hook of this process
    (``ring``: its ring file, found from the environment by default). True when it was also
    written into an existing ring of this process; False when only the environment carries it
    (the hook reads it there when it makes its ring)."""
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not 0 < seconds < 4e6:
        raise ValueError(f"a collective timeout of {seconds!r} s cannot be reported")
    os.environ[ENV] = f"{seconds:g}"
    path = ring if ring is not None else own_ring()
    if path is None or not path.exists():
        return False
    reader = H.RingReader(path)
    try:
        if reader.header.pid != os.getpid():  # another process's ring at that name: leave it
            return False
        ctl = reader.control()
        ctl.report_job_timeout(seconds)
    finally:
        reader.close()
    return True


def process_group_timeout(group: Any = None) -> timedelta:
    """The timeout of ``group``'s NCCL backend (default: the default process group), as
    ``init_process_group(timeout=...)`` / ``new_group(timeout=...)`` set it. LookupError when this
    PyTorch does not expose it: pass the timeout to :func:`report_pg_timeout` yourself."""
    import torch
    import torch.distributed as dist

    # Any: the options live on private attributes torch's stubs do not all declare
    pg: Any = group if group is not None else dist.distributed_c10d._get_default_group()

    def of_backend() -> Any:
        return pg._get_backend(torch.device("cuda")).options._timeout

    def of_group() -> Any:
        return pg.options._timeout

    tried: list[str] = []
    readers: tuple[tuple[str, Callable[[], Any]], ...] = (
        ("backend options", of_backend), ("group options", of_group))
    for name, read in readers:
        try:
            value = read()
        except (AttributeError, RuntimeError, TypeError) as exc:
            tried.append(f"{name}: {type(exc).__name__}")
            continue
        if isinstance(value, timedelta) and value.total_seconds() > 0:
            return value
        tried.append(f"{name}: {value!r}")
    raise LookupError("this PyTorch does not expose the process group's timeout (" +
                      "; ".join(tried) + "); pass it to report_pg_timeout()")
