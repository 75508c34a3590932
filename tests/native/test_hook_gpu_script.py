"""scripts/gpu_check.sh on a machine without a GPU: valid bash, a clean, explained failure, its
programs compile, and the hang check's watcher does on the fake GPU what it must on a real one."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from greyhound.fakejob import FakeJob, FakeJobSpec
from tests.native.helpers import wait_rings

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"
TRAIN = SCRIPT.with_name("gpu_check_train.py")


def test_gpu_check_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_gpu_check_fails_cleanly_without_a_gpu(tmp_path: Path) -> None:
    env = dict(os.environ, PATH=f"{tmp_path}:/usr/bin:/bin")  # no nvidia-smi on this PATH
    p = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert "nvidia-smi" in p.stderr
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    assert json.loads(last.removeprefix("RESULT "))["ok"] is False


def test_gpu_check_reports_missing_torch(tmp_path: Path) -> None:
    fake = tmp_path / "nvidia-smi"  # pretend a GPU exists; the torch check must then speak up
    fake.write_text("#!/bin/sh\necho 'GPU 0: fake'\n")
    fake.chmod(0o755)
    py = tmp_path / "python-without-torch"
    py.write_text("#!/bin/sh\nexec /usr/bin/env python3 -S -c 'import sys; sys.exit(1)'\n")
    py.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:/usr/bin:/bin", PYTHON=str(py))
    p = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "PyTorch is not importable" in p.stderr


def _embedded(name: str) -> str:
    """A program gpu_check_train.py runs in a subprocess (the module itself needs torch)."""
    tree = ast.parse(TRAIN.read_text())
    for node in tree.body:
        names = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
        if isinstance(node, ast.Assign) and name in names:
            value = ast.literal_eval(node.value)
            assert isinstance(value, str)
            return value
    raise AssertionError(f"{name} not found")


def test_gpu_check_programs_compile() -> None:
    subprocess.run([sys.executable, "-m", "py_compile", str(TRAIN)], check=True)
    for name in ("_AGENT", "_WATCHER"):
        compile(_embedded(name), name, "exec")


def test_gpu_check_watcher_sees_a_collective_hung_on_the_gpu(native_build: Path, tmp_path: Path) -> None:
    """The hang check's watcher (the agent's view of the GPU-side hang) run against the fake GPU:
    what it reports on the H200 is what it reports here, and it always releases the flag."""
    spec = FakeJobSpec(world_size=2, iters=400, compute_ms=5, compute_busy=0.0, job_id="watch")
    shm = tmp_path / "shm"
    with FakeJob(spec, workdir=tmp_path / "w", hook=native_build / "libgreyhound_hook.so",
                 shm_dir=shm) as job:
        rings = wait_rings(shm, "watch", 2)
        job.wait_iteration(0, 5, 30)
        job.faults.set("never_complete 0 20")  # the fake's seq 20: the hook's 21
        job.wait_iteration(1, 19, 30)
        time.sleep(0.3)
        flag, marker, out = tmp_path / "flag", tmp_path / "sync", tmp_path / "seen.json"
        flag.write_bytes(b"\0" * 4096)
        marker.write_text("")
        env = dict(os.environ, PYTHONPATH=str(SCRIPT.parents[1]))
        subprocess.run([sys.executable, "-c", _embedded("_WATCHER"), str(rings[0]), str(flag), str(marker),
                        str(out), str(shm), "watch"], env=env, check=True, timeout=60)
    seen = json.loads(out.read_text())
    assert flag.read_bytes()[:4] == (1).to_bytes(4, "little")  # the GPU is released
    rows = [r for sample in seen["samples"] for r in sample if r["calls_entered"] > 0]
    assert len(rows) >= 10
    assert {r["gpu_pending_seq"] for r in rows} == {21}
    ages = [(r["now_ns"] - r["gpu_pending_ns"]) / 1e9 for r in rows]
    assert ages[-1] > ages[0] + 1.5
    assert all(r["inflight_enter_ns"] == 0 for r in rows)
    assert seen["marker_present"] and seen["hang_watch"] is not None
