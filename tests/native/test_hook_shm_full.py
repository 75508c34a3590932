"""A full /dev/shm never harms training: the fake-NCCL job finishes normally, recording what it
can. Docker's /dev/shm is 64 MB; a ring is ~8.5 MB by default and up to 2 GiB.

A real small tmpfs needs a mount: inside a user and mount namespace (``unshare -Urm``) no root
is needed where the kernel allows unprivileged user namespaces; where it does not, that test is
skipped and the other two still run everywhere: posix_fallocate made to fail (a preloaded shim)
and RLIMIT_FSIZE (native/tests/test_ring_files.c).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from greyhound import hookabi as H
from greyhound.fakejob import FakeJob, FakeJobSpec

REPO = Path(__file__).resolve().parents[2]

# Runs inside the namespace, on a 4 MiB tmpfs mounted at argv[1]. Two jobs: one started on a
# tmpfs already full (no ring, the job runs), one whose tmpfs fills up after the rings were
# made (with a sparse file, the first record on a page not yet touched would be SIGBUS; the
# reserved pages keep recording). Prints the outcome as JSON.
_DRIVER = r"""
import json, os, sys, time
from pathlib import Path
from greyhound import hookabi as H
from greyhound.fakejob import FakeJob, FakeJobSpec

tmpfs, work = Path(sys.argv[1]), Path(sys.argv[2])
hook = Path(sys.argv[3])

def fill(name):
    fd = os.open(tmpfs / name, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)

def run(job_id, fill_first):
    shm = tmpfs / "shm"
    spec = FakeJobSpec(world_size=2, iters=400, compute_ms=0.5, pp=2, bytes=4096, job_id=job_id,
                       verbose=False)
    env = {"GREYHOUND_RING_RECORDS": "4096", "GREYHOUND_RING_KEEP": "1"}
    if fill_first:
        fill("filler-" + job_id)
    with FakeJob(spec, workdir=work / job_id, hook=hook, shm_dir=shm, env=env) as job:
        if not fill_first:
            deadline = time.monotonic() + 30
            while len(H.list_rings(shm, job_id)) < 2 and time.monotonic() < deadline:
                time.sleep(0.001)
            fill("filler-" + job_id)
        codes = job.wait(60)
    rings = H.list_rings(shm, job_id)
    heads = [H.RingReader(p).header.head for p in rings]
    leftovers = [p.name for p in (shm / job_id).glob(".*")] if (shm / job_id).exists() else []
    free = os.statvfs(tmpfs).f_bavail
    os.unlink(tmpfs / ("filler-" + job_id))
    return {"codes": codes, "rings": len(rings), "heads": heads, "leftovers": leftovers,
            "free_blocks_when_full": free}

print(json.dumps({"full": run("full", True), "fills": run("fills", False)}))
"""


def _userns_tmpfs_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-Urm", "sh", "-c", "mount -t tmpfs -o size=64k none /mnt"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.skipif(not _userns_tmpfs_works(),
                    reason="no unprivileged user+mount namespaces here to mount a small tmpfs")
def test_a_full_tmpfs_leaves_the_job_running(native_build: Path, tmp_path: Path) -> None:
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    hook = native_build / "libgreyhound_hook.so"
    cmd = ["unshare", "-Urm", "sh", "-c", 'mount -t tmpfs -o size=4m none "$0" && exec "$@"',
           str(mnt), sys.executable, str(script), str(mnt), str(tmp_path / "w"), str(hook)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    full, fills = out["full"], out["fills"]
    # Started full: no ring (recording disabled), nothing half-made left, training untouched.
    assert full["codes"] == [0, 0] and full["rings"] == 0 and full["leftovers"] == []
    # Filled up under the rings: no SIGBUS, and recording went on in the reserved pages.
    assert fills["codes"] == [0, 0] and fills["rings"] == 2, fills
    assert fills["free_blocks_when_full"] <= 1
    assert all(h > 1000 for h in fills["heads"]), fills  # far more than the first page holds


def test_a_ring_that_cannot_be_reserved_leaves_recording_off(native_build: Path,
                                                             tmp_path: Path) -> None:
    """posix_fallocate fails (ENOSPC, from a preloaded shim): no ring, no temporary, the job
    finishes."""
    shm = tmp_path / "shm"
    shim = native_build / "tests" / "libfail_fallocate.so"
    hook = native_build / "libgreyhound_hook.so"
    spec = FakeJobSpec(world_size=2, iters=30, compute_ms=1, bytes=4096, job_id="nospace",
                       verbose=False)
    with FakeJob(spec, workdir=tmp_path / "w", hook=None, shm_dir=shm,
                 env={"LD_PRELOAD": f"{shim} {hook}", "GREYHOUND_RING_KEEP": "1"}) as job:
        assert job.wait(60) == [0, 0]
    assert H.list_rings(shm, "nospace") == []
    assert list((shm / "nospace").iterdir()) == []  # the temporaries went too
    for r in range(2):  # and the hook said nothing
        assert (tmp_path / "w" / f"rank{r}.err").read_bytes() == b""
