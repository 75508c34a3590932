"""greyhound.hookabi.layout against the C header itself: struct offsets and sizes, and the value
of every enum member, flag and GH_* constant, both ways (a name on one side only fails)."""

from __future__ import annotations

import re
import subprocess
from enum import Enum
from pathlib import Path

import pytest

from greyhound.hookabi import layout as L

REPO = Path(__file__).resolve().parents[2]
HEADER = REPO / "native/include/greyhound_ring.h"

_PROBE = r"""
#include <stddef.h>
#include <stdio.h>
#include "greyhound_ring.h"
#define P(s, f) printf("%s %s %zu\n", #s, #f, offsetof(struct s, f));
#define S(s) printf("%s sizeof %zu\n", #s, sizeof(struct s));
#define V(n) printf("value %s %llu\n", #n, (unsigned long long)(n));
int main(void) {
@BODY@
  return 0;
}
"""

STRUCTS = {
    "gh_ring_header": L.HEADER_DTYPE,
    "gh_record": L.RECORD_DTYPE,
    "gh_comm_entry": L.COMM_DTYPE,
    "gh_control": L.CONTROL_DTYPE,
    "gh_bench_slot": L.BENCH_SLOT_DTYPE,
    "gh_prog_slot": L.PROG_SLOT_DTYPE,
    "gh_kch_slot": L.KCH_SLOT_DTYPE,
    "gh_progress": L.PROGRESS_DTYPE,
}
# Each C enum, the prefix of its members' names, and its Python mirror.
ENUMS: dict[str, tuple[str, type[Enum]]] = {
    "gh_op": ("GH_OP_", L.Op),
    "gh_mode": ("GH_MODE_", L.Mode),
    "gh_comm_state": ("GH_COMM_", L.CommState),
    "gh_bench_kind": ("GH_BENCH_", L.BenchKind),
    "gh_bench_state": ("GH_BENCH_", L.BenchState),
    "gh_gpu_api": ("GH_GPU_API_", L.GpuApi),
    "gh_prog_dir": ("GH_PROG_", L.ProgDir),
    "gh_step_state": ("GH_STEP_", L.StepState),
}
_GUARD = "GREYHOUND_RING_H"


def header_names() -> tuple[dict[str, list[str]], list[str], list[str]]:
    """The C names the header declares: members of each enum, flags, plain constants."""
    text = HEADER.read_text()
    enums = {}
    for enum in ENUMS:
        body = re.search(rf"enum {enum} \{{(.*?)\}}", text, re.S)
        assert body is not None, f"enum {enum} is not in the header"
        enums[enum] = re.findall(r"\b(GH_\w+)\s*=", body.group(1))
    defines = re.findall(r"^#define (GH_\w+)\s+\S", text, re.M)
    flags = [d for d in defines if d.startswith("GH_F_")]
    constants = [d for d in defines if not d.startswith("GH_F_") and d != _GUARD]
    return enums, flags, constants


def python_constant(c_name: str) -> str:
    """GH_MAX_COMMS -> MAX_COMMS; the magic is MAGIC."""
    name = c_name.removeprefix("GH_")
    return "MAGIC" if name == "RING_MAGIC" else name


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], int]:
    """Offsets, sizes and values as the C compiler sees them."""
    enums, flags, constants = header_names()
    lines = []
    for s, dt in STRUCTS.items():
        lines.append(f"S({s})")
        lines += [f"P({s}, {f})" for f in dt.names or ()]
    lines += [f"V({n})" for n in [*flags, *constants, *(n for ns in enums.values() for n in ns)]]
    tmp = tmp_path_factory.mktemp("probe")
    src = tmp / "probe.c"
    src.write_text(_PROBE.replace("@BODY@", "\n".join(lines)))
    exe = tmp / "probe"
    subprocess.run(["cc", "-I", str(HEADER.parent), "-o", str(exe), str(src)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {(a, b): int(c) for a, b, c in (line.split() for line in out.splitlines())}


def test_numpy_layout_matches_the_c_header(probe: dict[tuple[str, str], int]) -> None:
    for s, dt in STRUCTS.items():
        assert probe[(s, "sizeof")] == dt.itemsize, s
        for name in dt.names or ():
            assert probe[(s, name)] == dt.fields[name][1], (s, name)


@pytest.mark.parametrize("enum", list(ENUMS))
def test_enum_members_match_the_c_header(enum: str, probe: dict[tuple[str, str], int]) -> None:
    prefix, mirror = ENUMS[enum]
    c = {n.removeprefix(prefix): probe[("value", n)] for n in header_names()[0][enum]}
    py = {m.name: int(m.value) for m in mirror}
    assert c == py, mirror.__name__


def test_flags_match_the_c_header(probe: dict[tuple[str, str], int]) -> None:
    c = {n.removeprefix("GH_F_"): probe[("value", n)] for n in header_names()[1]}
    assert c == {f.name: int(f.value) for f in L.Flag}


def test_constants_match_the_c_header(probe: dict[tuple[str, str], int]) -> None:
    constants = header_names()[2]
    assert len(constants) >= 8  # magic, version, sizes: the parse found them
    for n in constants:
        assert getattr(L, python_constant(n)) == probe[("value", n)], n


def test_a_changed_value_would_be_caught(probe: dict[tuple[str, str], int]) -> None:
    """The comparison above is not vacuous: the probe's values are the header's, and one
    member moved on the Python side no longer matches."""
    assert probe[("value", "GH_OP_SEND")] == 7 and probe[("value", "GH_MODE_PROFILE")] == 1
    shifted = {m.name: int(m.value) + (m is L.Op.SEND) for m in L.Op}
    c = {n.removeprefix("GH_OP_"): probe[("value", n)] for n in header_names()[0]["gh_op"]}
    assert c != shifted
