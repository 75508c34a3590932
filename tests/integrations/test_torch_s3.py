"""S3 live in PyTorch, on CPU with gloo: scripts/torch_s3_check.py run as a user runs it.

4 processes, PP 2 x DP 2, Adam; at iteration 5 a role swap (the planner's role_swap core), a
consolidation of two stragglers (the consolidate core), and a run of failing versions. Needs
PyTorch; skipped when it is absent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e '.[torch]')")
# About 40 CPU-seconds (four processes importing torch, four runs of 10 iterations): under a
# minute on 2 idle cores, minutes on a loaded one; the bounds below leave ten times that.
pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
SWAP_AT = 5


@pytest.fixture(scope="module")
def check(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    out = tmp_path_factory.mktemp("s3") / "figures.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "scripts/torch_s3_check.py", "--steps", "10", "--swap-at", str(SWAP_AT),
         "--timeout", "600", "--json-out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=700, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    print("\n" + done.stdout)
    return json.loads(last.removeprefix("RESULT ")), json.loads(out.read_text())


def test_after_a_role_swap_training_equals_a_run_that_never_swapped(
        check: tuple[dict[str, Any], dict[str, Any]]) -> None:
    result, full = check
    assert set(result) >= {"loss_max_abs_diff", "param_max_abs_diff", "swapped_ranks_now_on_stage",
                           "pause_s"}
    assert result["ok"] is True
    assert result["loss_max_abs_diff"] < 1e-6 and result["param_max_abs_diff"] < 1e-6
    runs = full["runs"]
    ref, swap = runs["reference"]["losses"], runs["role_swap"]["losses"]
    # Training went on and did something: losses move, the moved state was not zeros.
    assert len(set(round(x, 6) for x in ref[SWAP_AT:])) > 1
    assert result["bytes_moved"] > 0
    assert swap == pytest.approx(ref, abs=1e-6)


def test_the_swapped_processes_run_each_others_stage(check: tuple[dict[str, Any], dict[str, Any]]) -> None:
    result, full = check
    assert result["swapped_ranks_now_on_stage"] == {"1": 1, "2": 0}
    stages = full["runs"]["role_swap"]["stages"]
    assert stages[1] == [0] * SWAP_AT + [1] * (10 - SWAP_AT)
    assert stages[2] == [1] * SWAP_AT + [0] * (10 - SWAP_AT)
    assert stages[0] == [0] * 10 and stages[3] == [1] * 10
    outcome = full["runs"]["role_swap"]["outcomes"][0]
    assert outcome["applied"] and sorted(outcome["moved"]) == [1, 2]
    assert outcome["iteration"] == SWAP_AT and outcome["layout_changed"] is True
    # The pause is measured and reported to the planner as the version's cost.
    assert 0 < result["pause_s"] < 60
    report = full["runs"]["role_swap"]["reports"][0]
    assert report["applied"] and report["cost_s"] == result["pause_s"]


def test_consolidation_gathers_two_stragglers_into_one_stage(
        check: tuple[dict[str, Any], dict[str, Any]]) -> None:
    result, full = check
    assert len(result["consolidate_straggler_stages"]) == 1
    stages = full["runs"]["consolidate"]["stages"]
    assert stages[1][SWAP_AT - 1] != stages[2][SWAP_AT - 1]  # apart before
    assert stages[1][-1] == stages[2][-1]  # together after
    assert full["figures"]["consolidate"]["param_max_abs_diff"] < 1e-6


def test_a_failure_at_any_step_leaves_the_old_layout_and_reports_failed_with_why(
        check: tuple[dict[str, Any], dict[str, Any]]) -> None:
    _, full = check
    run = full["runs"]["failures"]
    errors = {o["version"]: o["error"] for o in run["outcomes"]}
    assert "permutation" in errors[1]
    assert "process 3: building the new process groups" in errors[2]
    assert "process 1: moving state to rank 2" in errors[3] and "out of memory" in errors[3]
    assert errors[4] is None
    assert run["gpu_of_rank"] == [0, 1, 2, 3]
    assert all(len(set(s)) == 1 for s in run["stages"])
    assert [(r["version"], r["applied"]) for r in run["reports"]] == [
        (1, False), (2, False), (3, False), (4, True)]
    assert full["figures"]["failures"]["loss_max_abs_diff"] < 1e-6
