"""scripts/gpu_check_pause.py without a GPU: its arguments, a clean and explained failure where
PyTorch with CUDA is missing, and its three checks run on the fake workload (a single-rank job
whose communicator is used only inside groups, with a reported process-group timeout), which is
what the script's PyTorch child does on a real GPU. The script itself is not run on a GPU here."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from greyhound import hookabi as H
from greyhound.fakejob import FakeJob, FakeJobSpec
from tests.native.helpers import hook_lib

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check_pause.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check_pause", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_arguments_and_their_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gc = _script()
    monkeypatch.setenv("OUT", str(tmp_path / "o"))
    args = gc.parse_args([])
    assert (args.out, args.pg_timeout, args.pause, args.bench_timeout) == (tmp_path / "o", 20.0,
                                                                          25.0, 3.0)
    assert args.hook.name == "libgreyhound_hook.so" and not args.child
    assert gc.parse_args(["--out", "x", "--pg-timeout", "8"]).out == Path("x")
    with pytest.raises(SystemExit):
        gc.parse_args(["--pause", "0"])


def test_without_pytorch_and_cuda_it_fails_cleanly_with_its_json(tmp_path: Path) -> None:
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("PyTorch is installed: the failure path is not the one this machine takes")
    p = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True,
                       text=True, timeout=120, check=False)
    assert p.returncode == 1, p.stderr
    last = json.loads(p.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    assert last["ok"] is False and "PyTorch with CUDA and NCCL is not usable" in last["error"]
    assert json.loads((tmp_path / "gpu_check_pause.json").read_text()) == last


class FakeRank:
    """The fake workload's rank 0 as the checks see a training process."""

    def __init__(self, job: FakeJob, shm: Path) -> None:
        self.job = job
        self.ring = H.ring_path(shm, job.spec.job_id, 0)

    def iterations(self) -> int:
        return len(self.job.iterations(0))

    def alive(self) -> bool:
        return self.job.running()


def test_the_checks_pass_on_a_single_rank_job_of_groups(native_build: Path, tmp_path: Path
                                                       ) -> None:
    gc = _script()
    spec = FakeJobSpec(world_size=1, iters=100_000, compute_ms=10, compute_busy=0.5,
                       job_id="gpucheck", dp_grouped=True, dp_buckets=(2,), pg_timeout_s=4.0)
    shm = tmp_path / "shm"
    with FakeJob(spec, workdir=tmp_path / "w", hook=hook_lib(native_build), shm_dir=shm,
                 env={"GREYHOUND_BENCH_TIMEOUT_MS": "500"}) as job:
        out = gc.run_checks(FakeRank(job, shm), pg_timeout_s=4.0, pause_s=5.0,
                            bench_timeout_s=0.5)
    assert out["ok"], json.dumps(out, indent=2)
    g, lonely, cap = out["groups"], out["lonely_send"], out["timeout_cap"]
    assert g["calls_only_in_groups"] and g["marks_cleared_after_group_end"] and g["parked"]
    assert lonely["send_state"] == "FAILED" and lonely["bench_comms_aborted"] == 1
    assert lonely["send_result"] == 600  # cudaErrorNotReady: nobody received
    assert cap["pause_cap_ms"] == 1000 and 0.5 <= cap["held_s"] < 4.0
    assert cap["validator_budget_s"] == 1.0 and cap["job_alive"]
