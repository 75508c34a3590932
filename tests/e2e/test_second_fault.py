"""A second fault while the first is open, end to end with the live simulator (64 GPUs, TP8 DP4
PP2) through agent, tracker, analyzer and validator: each fault is its own incident with its
own culprit. Scenarios in scenarios/: a GPU at 100 s then a congested DP link from 200 s to
400 s (the link's incident resolves when it clears, the GPU's stays open), and a second GPU
that slows while the first is still slow. Run at 25x virtual time (about 20-30 s each); on a
loaded machine the simulator falls behind that pace rather than leaping to catch up (see
greyhound.sim.live), so the services keep the same virtual time to answer in."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from greyhound.sim.live import LiveSimulation
from greyhound.sim.scenario import load_scenario
from stack.up import Stack
from tests.e2e.conftest import incidents

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"
SPEED = 25.0


def _run(stack: Stack, name: str, job: str,
         done: Callable[[list[dict[str, Any]], float], bool]) -> list[dict[str, Any]]:
    """Play the scenario until done(incidents, virtual seconds) or its end; the incidents."""
    sim = LiveSimulation(load_scenario(SCENARIOS / f"{name}.yaml"), stack.settings.shm_dir, job,
                         speed=SPEED)
    seen: list[list[dict[str, Any]]] = [[]]
    next_poll = [0.0]

    def should_stop() -> bool:
        assert not stack.dead(), f"services died: {stack.dead()}"
        if time.monotonic() >= next_poll[0]:
            next_poll[0] = time.monotonic() + 0.5
            seen[0] = incidents(stack, job)
            return done(seen[0], sim.virtual_s)
        return False

    try:
        sim.run(should_stop=should_stop)
    finally:
        sim.close(remove=True)
    return incidents(stack, job)


def _describe(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(r["kind"], r["status"], r["culprit"], [e["stage"] for e in r["timeline"]])
            for r in rows]


def _named(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Localised slowdown incidents, oldest first."""
    return sorted((r for r in rows if r["kind"].endswith("_slow")), key=lambda r: r["opened_at"])


def test_link_congested_while_a_gpu_is_slow(stack: Stack) -> None:
    job = f"second-link-{uuid.uuid4().hex[:6]}"

    def done(rows: list[dict[str, Any]], virtual_s: float) -> bool:
        named = _named(rows)
        return len(named) >= 2 and named[1]["status"] == "resolved" and virtual_s > 400

    rows = _run(stack, "second-fault-link-m64", job, done)
    named = _named(rows)
    assert len(named) == 2, _describe(rows)
    gpu, link = named
    assert gpu["kind"] == "compute_slow" and gpu["culprit"]["compute_ranks"] == [9], \
        _describe(rows)
    assert gpu["status"] != "resolved", _describe(rows)
    # The link's own incident: the link, not the GPU named before it.
    culprit = link["culprit"]
    assert link["kind"] in ("comm_slow", "mixed_slow"), _describe(rows)
    assert culprit["links"] == [[4, 5]] and 9 not in culprit["compute_ranks"], _describe(rows)
    # It says what it was opened for: a further slowdown, with the levels either side.
    detected = link["timeline"][0]["detail"]
    assert detected["change"] == "further", detected
    assert detected["after_s"] > 1.1 * detected["before_s"] > 1.1 * detected["healthy_s"]
    # It ended at ~400 s with a partial recovery; the GPU's incident heard of both changes.
    resolved = [e["detail"] for e in link["timeline"] if e["stage"] == "resolved"]
    assert resolved and resolved[0]["change"] == "partial", _describe(rows)
    notes = [e["detail"].get("further") for e in gpu["timeline"]]
    assert link["id"] in notes, _describe(rows)


def test_second_gpu_slows_while_the_first_is_slow(stack: Stack) -> None:
    job = f"second-gpu-{uuid.uuid4().hex[:6]}"

    def done(rows: list[dict[str, Any]], virtual_s: float) -> bool:
        return len(_named(rows)) >= 2

    rows = _run(stack, "second-gpu-m64", job, done)
    named = _named(rows)
    assert [r["culprit"]["compute_ranks"] for r in named] == [[9], [42]], _describe(rows)
    assert all(r["kind"] == "compute_slow" for r in named), _describe(rows)
    assert all(r["status"] != "resolved" for r in named), _describe(rows)
    assert named[1]["timeline"][0]["detail"]["change"] == "further", _describe(rows)
