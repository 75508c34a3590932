"""``greyhound plan microbatch``: the allocation as JSON, or a clear message and exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stack.cli import main


def test_prints_allocation_and_makespan(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "microbatch", "--times", "1.85,1,1,1", "--microbatches", "64",
               "--multiple-of", "2"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out) == {"allocation": [10, 18, 18, 18], "makespan": 18.5}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--times", "1,1,1", "--microbatches", "2"], "microbatches 2 < 3"),
        (["--times", "1,-1", "--microbatches", "4"], "positive"),
        (["--times", "1,1", "--microbatches", "5", "--multiple-of", "2"], "not a multiple of 2"),
        (["--times", "", "--microbatches", "4"], "empty"),
    ],
)
def test_bad_input_exits_2_with_message(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "microbatch", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err


def test_unparsable_times_exit_2_from_the_console_script() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "stack.cli", "plan", "microbatch", "--times", "1,x",
         "--microbatches", "4"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "expected comma-separated seconds" in done.stderr
    assert done.stdout == ""
