"""The hook's C unit tests (stub NCCL target), plain and under Address/ThreadSanitizer."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

NATIVE = Path(__file__).resolve().parents[2] / "native"


@pytest.mark.parametrize("target", ["test", "asan", "tsan"])
def test_native_c_suite(target: str) -> None:
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    p = subprocess.run(["make", "-s", "-C", str(NATIVE), target], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    for name in ("test_hook_api: ok", "test_hook_stress: ok", "test_hook_rtld_local: ok",
                 "test_hook_marks: ok", "test_hook_lease: ok", "test_ring_race: ok",
                 "test_ring_files: ok"):
        assert name in p.stdout
    assert "WARNING: ThreadSanitizer" not in p.stderr and "ERROR: AddressSanitizer" not in p.stderr
