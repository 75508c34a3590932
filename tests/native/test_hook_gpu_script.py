"""scripts/gpu_check.sh on a machine without a GPU: valid bash, and a clean, explained failure."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


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
