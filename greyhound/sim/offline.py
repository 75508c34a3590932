"""Offline runs: the iteration-time series of a scenario, for sweeps and for ``greyhound detect``."""

from __future__ import annotations

from collections.abc import Iterator

from greyhound.sim.model import ClusterModel
from greyhound.sim.scenario import Scenario


def run_offline(scenario: Scenario) -> Iterator[float]:
    """Iteration times in seconds until ``duration_s`` of virtual time; stops at a hang."""
    model = ClusterModel(scenario)
    t = 0.0
    while t < scenario.duration_s:
        timing = model.iteration(t, events=False)
        if timing.hung:
            return
        yield timing.duration_s
        t += timing.duration_s
