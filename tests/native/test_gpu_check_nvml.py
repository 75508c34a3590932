"""scripts/gpu_check_nvml.py (the GPU check's NVML step) on the fake NVML: it reads every GPU
through the agent's sampler and reports what it read; without NVML it fails with a clear result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from greyhound.fakejob import FaultFile, native_build_dir

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check_nvml.py"


def run(env: dict[str, str]) -> tuple[int, dict[str, object]]:
    p = subprocess.run([sys.executable, str(SCRIPT)], env={**os.environ, **env},
                       capture_output=True, text=True, timeout=120)
    return p.returncode, json.loads(p.stdout.strip().splitlines()[-1])


def test_reads_the_fake_gpus_through_the_sampler(tmp_path: Path) -> None:
    faults = FaultFile(tmp_path / "faults.txt")
    faults.set("nvml_throttle 1 power")
    rc, res = run({"GREYHOUND_AGENT_NVML_LIB": str(native_build_dir() / "fake" / "libnvidia-ml.so.1"),
                   "FAKE_NCCL_FAULTS": str(faults.path), "FAKE_NVML_GPUS": "2",
                   "CUDA_VISIBLE_DEVICES": ""})
    assert rc == 0 and res["ok"] is True and res["gpus"] == 2, res
    loaded = res["loaded"]
    assert isinstance(loaded, dict)
    assert loaded["1"]["throttle"] == ["sw_power_cap"] and loaded["1"]["sm_clock_mhz"] == 1410
    assert loaded["0"]["throttle"] == [] and res["absent_fields"] == {}


def test_without_nvml_the_result_says_so(tmp_path: Path) -> None:
    rc, res = run({"GREYHOUND_AGENT_NVML_LIB": str(tmp_path / "libnvidia-ml.so.1")})
    assert rc == 1 and res == {"ok": False, "error": "NVML did not open"}
