"""A rank's CUDA device ordinal through its CUDA_VISIBLE_DEVICES to the NVML index."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from services.agent.visible_devices import nvml_index, read_visible

UUIDS = {f"GPU-fa4e0000-0000-0000-0000-00000000000{i}": i for i in range(4)}
UUIDS["GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"] = 7


@pytest.mark.parametrize(("ordinal", "visible", "expected"), [
    (0, None, 0),                      # unset: the ordinal is the index
    (3, None, 3),
    (-1, None, None),                  # no device
    (0, ["3"], 3),                     # one GPU per rank
    (1, ["5", "2"], 2),
    (2, ["5", "2"], None),             # past the list
    (0, ["GPU-fa4e0000-0000-0000-0000-000000000002"], 2),
    (0, ["GPU-8932f937"], 7),          # a unique prefix, as CUDA accepts
    (0, ["GPU-fa4e0000"], None),       # a prefix of four: not unique
    (0, ["MIG-2d0c1a7e-1234"], None),  # a MIG instance: not a GPU NVML samples
    (1, ["2", "bogus", "3"], None),    # CUDA stops at the first entry it cannot parse
    (0, ["2", "bogus", "3"], 2),
    (0, [""], None),                   # set but empty: no device visible
    (0, ["-1"], None),
])
def test_nvml_index(ordinal: int, visible: list[str] | None, expected: int | None) -> None:
    assert nvml_index(ordinal, visible, UUIDS) == expected


def test_read_visible_from_a_live_process() -> None:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    with subprocess.Popen(["sleep", "30"], env={**env, "CUDA_VISIBLE_DEVICES": "3, 1"}) as bound, \
            subprocess.Popen(["sleep", "30"], env=env) as unbound:
        try:
            assert read_visible(bound.pid) == ["3", "1"]
            assert read_visible(unbound.pid) is None
        finally:
            bound.kill()
            unbound.kill()


def test_read_visible_when_the_process_cannot_be_read(tmp_path: Path) -> None:
    assert read_visible(0) is None
    assert read_visible(123, proc=tmp_path) is None  # not in this PID namespace
    (tmp_path / "124").mkdir()
    (tmp_path / "124" / "environ").write_bytes(b"A=1\0CUDA_VISIBLE_DEVICES=0,2\0B=2\0")
    assert read_visible(124, proc=tmp_path) == ["0", "2"]
