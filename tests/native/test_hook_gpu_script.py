"""scripts/gpu_check.sh on a machine without a GPU: valid bash, a clean, explained failure, its
programs compile, and the hang check's watcher does on the fake GPU what it must on a real one."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from greyhound import hookabi as H
from greyhound.fakejob import FakeJob, FakeJobSpec
from tests.native.helpers import wait_rings

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"
TRAIN = SCRIPT.with_name("gpu_check_train.py")
DRIVER = SCRIPT.with_name("gpu_check_driver.py")
NVML = SCRIPT.with_name("gpu_check_nvml.py")
SUMMARY = SCRIPT.with_name("gpu_check_summary.py")
PAUSE = SCRIPT.with_name("gpu_check_pause.py")
PROFILER = SCRIPT.with_name("gpu_check_profiler.py")
PLAN = SCRIPT.with_name("gpu_check_plan.sh")


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
    for prog in (TRAIN, DRIVER, NVML, SUMMARY, PAUSE, PROFILER):
        subprocess.run([sys.executable, "-m", "py_compile", str(prog)], check=True)
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
    # the tracker's hang watch ran on the agent's rows (its imports hold) and raised the hang
    assert seen["marker_present"] and isinstance(seen["hang_watch"], dict), seen["hang_watch"]
    assert seen["hang_watch"]["findings"], seen["hang_watch"]


def test_gpu_check_driver_step_over_the_fake_driver(native_build: Path, tmp_path: Path) -> None:
    """The driver step (no torch, no libcudart: NCCL and the driver only) against the fake NCCL
    and the fake driver: marks and profile times through the driver API, the bus id recorded."""
    env = dict(os.environ, GREYHOUND_SHM_DIR=str(tmp_path / "shm"), GREYHOUND_JOB_ID="drv",
               RANK="0", WORLD_SIZE="1", GH_NCCL_LIB=str(native_build / "fake" / "libnccl.so.2"),
               LD_LIBRARY_PATH=str(native_build / "fake"),
               LD_PRELOAD=str(native_build / "libgreyhound_hook.so"))
    p = subprocess.run([sys.executable, str(DRIVER)], env=env, capture_output=True, text=True,
                       timeout=120)
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert p.returncode == 0 and res["ok"], (res, p.stderr[-2000:])
    assert res["gpu_api"] == 2 and not res["libcudart_loaded"]
    assert res["pci_bus_id_hook"] == res["pci_bus_id_driver"] == "0000:18:00.0"
    assert res["profile"]["gpu_done"] >= 3 and "skipped" in res["gate"]
    # the hook is what made it work: without it the same process has no ring, and says so
    env.pop("LD_PRELOAD")
    bare = subprocess.run([sys.executable, str(DRIVER)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert bare.returncode == 1 and not json.loads(bare.stdout.strip().splitlines()[-1])["ok"]


def test_gpu_check_nvml_step_without_pydantic_reads_nvml_through_ctypes(native_build: Path,
                                                                        tmp_path: Path) -> None:
    env = dict(os.environ, GH_NVML_CTYPES="1", FAKE_NVML_GPUS="3",
               GREYHOUND_AGENT_NVML_LIB=str(native_build / "fake" / "libnvidia-ml.so.1"),
               FAKE_NCCL_FAULTS=str(tmp_path / "none.txt"), CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, str(NVML)], env=env, capture_output=True, text=True,
                       timeout=120)
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert p.returncode == 0 and res["ok"] and res["via"] == "ctypes", res
    assert res["bus_ids"] == {"0": "00000000:18:00.0", "1": "00000000:29:00.0", "2": "00000000:3A:00.0"}


def _steps(tmp_path: Path, **over: dict[str, object]) -> Path:
    """Step results as a passing run on a GPU would leave them (each overridable)."""
    mem = {"process_mib": 500, "device_used_mib": 600}
    steps: dict[str, dict[str, object]] = {
        "base": {"ms_per_step": 1.0, "us_per_allreduce_call": 20.0, "memory": mem},
        "monitor": {"records": 300, "gpu_marks": 1, "ms_per_step": 1.01, "pci_bus_id_hook": "0000:1B:00.0",
                    "pci_bus_id_torch": "0000:1B:00.0", "memory": {**mem, "process_mib": 502}},
        "profile": {"gpu_done": 300, "gemm_ok": True, "memory": {**mem, "process_mib": 506}},
        "capture_base": {"ok": True}, "capture_monitor": {"ok": True}, "capture_profile": {"ok": True},
        "gputime": {"ok": True, "profile": {"out_of_place": {"gpu_start_after_enqueue_ms": 50.2,
                                                             "gpu_duration_us": 31.0}}},
        "async": {"queued": {"ok": True}, "hang": {"ok": True}}, "driver": {"ok": True},
        "nvml": {"ok": True, "via": "ctypes", "bus_ids": {"0": "00000000:1B:00.0", "1": "00000000:43:00.0"}},
        "pause": {"ok": True, "groups": {"ok": True}, "lonely_send": {"ok": True},
                  "timeout_cap": {"ok": True, "held_s": 5.0}},
        "profiler": {"ok": True, "plugin_version": 5, "events_monitor": {"P2P": 40}},
    }
    for name, value in over.items():
        steps[name] = value
    out = tmp_path / "gpu_check"
    out.mkdir(parents=True)
    for name, value in steps.items():
        (out / f"{name}.json").write_text(json.dumps(value))
    return out


def _summary(res: Path) -> tuple[int, dict[str, object]]:
    p = subprocess.run([sys.executable, str(SUMMARY), str(res)], capture_output=True, text=True,
                       timeout=60)
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT ") and (res / "result.json").exists()
    return p.returncode, json.loads(last.removeprefix("RESULT "))


def test_gpu_check_summary_passes_a_good_run(tmp_path: Path) -> None:
    rc, res = _summary(_steps(tmp_path))
    assert rc == 0 and res["ok"] and res["pci_ok"] and res["memory_ok"], res
    assert res["gpu_memory"] == {"unhooked_mib": 500, "monitor_mib": 502, "profile_mib": 506,
                                 "added_monitor_mib": 2, "added_profile_mib": 6, "ok": True}


def test_gpu_check_summary_fails_on_a_wrong_bus_id_memory_or_a_skipped_step(tmp_path: Path) -> None:
    wrong_bus = {"records": 300, "gpu_marks": 1, "pci_bus_id_hook": "0000:99:00.0",
                 "memory": {"process_mib": 502}}
    rc, res = _summary(_steps(tmp_path / "a", monitor=wrong_bus))
    assert rc == 1 and not res["ok"] and not res["pci_ok"] and res["memory_ok"]
    heavy = {"gpu_done": 300, "gemm_ok": True, "memory": {"process_mib": 1500}}
    rc, res = _summary(_steps(tmp_path / "b", profile=heavy))
    assert rc == 1 and not res["memory_ok"] and res["pci_ok"]
    rc, res = _summary(_steps(tmp_path / "c", driver={"ok": False, "skipped": "budget"}))
    assert rc == 1 and res["skipped"] == ["driver"]


def test_gpu_check_summary_fails_when_the_pause_checks_fail_or_did_not_run(tmp_path: Path) -> None:
    cut_late = {"ok": False, "groups": {"ok": True}, "lonely_send": {"ok": True},
                "timeout_cap": {"ok": False, "held_s": 24.9}}
    rc, res = _summary(_steps(tmp_path / "a", pause=cut_late))
    assert rc == 1 and not res["ok"] and not res["pause_ok"] and res["pci_ok"], res
    steps = _steps(tmp_path / "b")
    (steps / "pause.json").unlink()
    rc, res = _summary(steps)
    assert rc == 1 and not res["pause_ok"]


def test_gpu_check_runs_the_pause_step_before_the_summary() -> None:
    text = SCRIPT.read_text()
    step = re.search(r'^step pause 0 "\$PY" "\$ROOT/scripts/gpu_check_pause.py" --out "\$RES/pause"$',
                     text, re.M)
    assert step is not None and step.start() < text.index("gpu_check_summary.py\" \"$RES\"")


def _timeout(name: str, spent: int, budget: int = 460) -> int:
    """What scripts/gpu_check_plan.sh gives step ``name`` once ``spent`` s of ``budget`` are gone."""
    p = subprocess.run(["bash", "-c", f'source "{PLAN}"; gh_check_timeout {name} {spent} {budget}'],
                       capture_output=True, text=True, check=True, timeout=30)
    return int(p.stdout)


def test_gpu_check_runs_every_step_of_its_plan_and_the_plan_fits_the_budget() -> None:
    """The budget's arithmetic: the steps' needs (and the gaps between them) fit in the 460 s,
    each step keeps what the later ones need, so when every step overruns its need as far as it
    is let, the last one still gets its need (the old limits added up to 880 s: the last step
    could be skipped)."""
    plan = [line.split() for line in re.search(r'GH_CHECK_PLAN="(.*?)"', PLAN.read_text(), re.S)
            .group(1).strip().splitlines()]  # type: ignore[union-attr]
    names = [p[0] for p in plan]
    called = re.findall(r'^(?:\w+=\S+ )*step (\w+) [01] ', SCRIPT.read_text(), re.M)
    assert called == names and names[-2:] == ["profiler", "pause"]
    gap = 2
    assert sum(int(p[1]) + gap for p in plan) <= 460
    spent = 0
    for name, need, limit in plan:
        got = _timeout(name, spent, 460)
        assert int(need) <= got <= int(limit), (name, spent, got)
        spent += got + gap  # the worst case: every step runs out its timeout
    assert spent <= 460 + gap
    assert _timeout("pause", 460 - 50) == 0  # what cannot get its need says so (skipped)
    assert _timeout("no_such_step", 0) == 0


def test_gpu_check_profiler_step_over_the_fake_nccl(native_build: Path, tmp_path: Path) -> None:
    """The profiler step against the fake NCCL through ctypes (the GPU run goes through PyTorch):
    the hook named as the plugin is the preloaded instance, NCCL takes v5 (2.28), the caller's
    events are bound to the interposer's comm table, profile mode brings the costly classes."""
    hook = native_build / "libgreyhound_hook.so"
    env = dict(os.environ, GREYHOUND_SHM_DIR=str(tmp_path / "shm"), GREYHOUND_JOB_ID="prof",
               RANK="0", WORLD_SIZE="1", GH_PROFILER_VIA="ctypes",
               GH_NCCL_LIB=str(native_build / "fake" / "libnccl.so.2"),
               LD_LIBRARY_PATH=str(native_build / "fake"), LD_PRELOAD=str(hook))
    env.pop("NCCL_PROFILER_PLUGIN", None)
    p = subprocess.run([sys.executable, str(PROFILER)], env=env, capture_output=True, text=True,
                       timeout=120)
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert p.returncode == 0 and res["ok"], (res, p.stderr[-2000:])
    assert res["plugin"] == str(hook) and res["plugin_version"] == 5 and res["unbound"] == 0
    assert res["events_monitor"]["P2P"] == 40 and "KERNEL_LAUNCH" not in res["events_monitor"]
    assert res["events_profile"]["KERNEL_LAUNCH"] > 0
    assert int(res["mask_default"], 16) & int(H.ProfileClass.KERNEL_LAUNCH) == 0
    # without the hook preloaded there is no plugin to name, and the step says it failed
    env.pop("LD_PRELOAD")
    bare = subprocess.run([sys.executable, str(PROFILER)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert bare.returncode == 1 and not json.loads(bare.stdout.strip().splitlines()[-1])["ok"]
