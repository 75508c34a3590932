"""``greyhound sim run --offline`` prints one iteration time per line."""

from __future__ import annotations

from pathlib import Path

import pytest

from greyhound.sim.cli import main


def test_offline_prints_iteration_times(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(
        "job: {tp: 2, dp: 2, pp: 2, gpus_per_node: 2, microbatches: 4, microbatch_compute_s: 0.1,\n"
        "      dp_allreduce_bytes: 1.0e8, pp_activation_bytes: 1.0e6, link_gbps: 400,\n"
        "      nvlink_gbps: 3600}\nduration_s: 5\nseed: 2\n"
    )
    assert main(["run", str(path), "--offline"]) == 0
    lines = capsys.readouterr().out.splitlines()
    values = [float(x) for x in lines]
    assert len(values) > 5 and all(0.3 < v < 1.0 for v in values)


def test_bad_scenario_is_reported_with_its_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("job: {tp: 2}\nduration_s: 5\n")
    assert main(["run", str(path), "--offline"]) == 2
    assert "job.dp" in capsys.readouterr().err


def test_simulator_core_imports_no_service_packages() -> None:
    import subprocess
    import sys

    code = (
        "import sys, greyhound.sim.model, greyhound.sim.offline, greyhound.sim.cli; "
        "bad = [m for m in ('nats', 'sqlalchemy', 'fastapi') if m in sys.modules]; "
        "sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_a_live_run_goes_to_the_runner_the_caller_gives(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(
        "job: {tp: 1, dp: 2, pp: 1, gpus_per_node: 2, microbatches: 2, microbatch_compute_s: 0.1,\n"
        "      dp_allreduce_bytes: 1.0e6, pp_activation_bytes: 1.0e6, link_gbps: 400,\n"
        "      nvlink_gbps: 3600}\nduration_s: 2\nname: live-one\n"
    )
    assert main(["run", str(path)]) == 2  # the library alone cannot run the services
    assert "needs the services" in capsys.readouterr().err
    calls = []

    def live(scenario, args):
        calls.append((scenario.name, args.speed, args.json))
        return 7

    assert main(["run", str(path), "--speed", "3", "--json"], live=live) == 7
    assert calls == [("live-one", 3.0, True)]
