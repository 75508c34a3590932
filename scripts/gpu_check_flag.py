"""A GPU-side gate for the GPU check's scripts: a page of shared memory registered with the GPU,
which a stream waits on (cuStreamWaitValue32) until the host writes 1 into it. Plain ctypes: the
scripts that use it run with and without torch."""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Flag:
    path: Path  # the page's file (another process can map it and release the gate)
    page: mmap.mmap
    addr: int  # host address
    dptr: int  # the GPU's address of the same page

    def release(self) -> None:
        self.page[0:4] = (1).to_bytes(4, "little")


def gpu_flag(cu: ctypes.CDLL, prefix: str) -> Flag | str:
    """A zeroed page under /dev/shm (tmpfs pages pin reliably), registered as device-mapped;
    a message when the driver will not."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=shm)) / "flag"
    path.write_bytes(b"\0" * 4096)
    fd = os.open(path, os.O_RDWR)
    page = mmap.mmap(fd, 4096)
    os.close(fd)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(page))
    dptr = ctypes.c_uint64()
    rc = cu.cuMemHostRegister_v2(ctypes.c_void_p(addr), ctypes.c_size_t(4096),
                                 ctypes.c_uint(0x02))  # CU_MEMHOSTREGISTER_DEVICEMAP
    if rc == 0:
        rc = cu.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ctypes.c_void_p(addr), ctypes.c_uint(0))
    if rc != 0:
        return f"registering the flag page failed (CUresult {rc})"
    return Flag(path, page, addr, dptr.value)


def unregister(cu: ctypes.CDLL, flag: Flag) -> None:
    cu.cuMemHostUnregister(ctypes.c_void_p(flag.addr))
