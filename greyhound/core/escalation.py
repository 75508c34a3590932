"""When to act on a fail-slow, and how hard: GREYHOUND's ski-rental escalation (Algorithm 1).

A fail-slow's severity is measurable from the first slow iterations; its duration is not (under a
minute to ten hours). Acting costs time up front (S2 re-balancing: little; S3 topology change: a
pause of about a minute; S4 checkpoint-restart: tens of minutes or more), ignoring it costs time
for as long as it lasts. Like renting skis until the rent paid equals the price of buying, each
incident starts at S1 (ignore) and keeps the cumulative loss, the sum over slow iterations of
(iteration time - healthy iteration time); it moves to the next strategy once that loss reaches
the next strategy's overhead and the current strategy has not brought the job back within the
tolerance. Whatever the duration turns out to be, the loss is then within a constant factor of
what knowing it in advance would have cost.

Only strategies that can help the kind are on its ladder: S2 re-balances compute stragglers and
does nothing for a congested link, S3 serves both, S4 comes last. An iteration within the
tolerance of the healthy time is not slow: it adds no loss and stops the escalation (the current
strategy is working). While a plan is awaiting application, nothing escalates further.

Severity is measurable, duration is not, but its distribution is known: GREYHOUND's field study
found compute fail-slows last 10 minutes on average and congestions 24, far past the break-even
of a one-minute S3. With a predicted duration and a trust ``trust`` (lambda in (0, 1]) the
escalation is the learning-augmented ski rental of Purohit, Svitkina and Kumar (NeurIPS 2018):
when the fault is predicted to outlast the break-even (its predicted duration is longer than the
time in which its current loss rate would pay the next overhead), it buys once
the loss reaches lambda x overhead; otherwise at overhead / lambda. Its cost is within
(1 + lambda) of the optimum when the prediction is right and within (1 + 1/lambda) whatever the
duration (break-even alone: 2 and 2). ``trust=1`` (or no prediction) is Algorithm 1 as
published.

Overheads start from inputs (settings) and learn from what applying a plan actually cost: each
observed cost moves the estimate by an exponentially weighted moving average,
``estimate <- (1 - alpha) estimate + alpha observed`` (alpha = 0.5 by default: one observation
halves the error, a stale setting is forgotten within a few incidents). Read the estimates from
``overheads`` to carry them into the next incident.

When the fail-slow ends, the plan in force is reverted (S2's uneven split and S3's layout are only
better while the fault lasts); a restart has nothing to revert.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Literal

FailSlowKind = Literal["compute", "communication", "mixed"]


class Strategy(IntEnum):
    IGNORE = 1
    MICROBATCH = 2
    TOPOLOGY = 3
    RESTART = 4


LADDERS: dict[FailSlowKind, tuple[Strategy, ...]] = {
    "compute": (Strategy.IGNORE, Strategy.MICROBATCH, Strategy.TOPOLOGY, Strategy.RESTART),
    "communication": (Strategy.IGNORE, Strategy.TOPOLOGY, Strategy.RESTART),
    "mixed": (Strategy.IGNORE, Strategy.MICROBATCH, Strategy.TOPOLOGY, Strategy.RESTART),
}


@dataclass(frozen=True, slots=True)
class Apply:
    """Apply ``strategy`` now: the loss so far has reached ``threshold_s``, its estimated
    overhead (times the trust, or over it, when a predicted duration is used)."""

    strategy: Strategy
    loss_s: float
    overhead_s: float
    reason: str
    threshold_s: float


@dataclass(frozen=True, slots=True)
class Revert:
    """Undo ``strategy``'s plan: the fail-slow it worked around has ended."""

    strategy: Strategy
    reason: str


Decision = Apply | Revert


class Escalation:
    """One incident's state machine: feed it iteration times and events, act on its decisions."""

    def __init__(
        self,
        kind: FailSlowKind,
        healthy_iteration_s: float,
        overheads_s: Mapping[Strategy, float],
        *,
        tolerance: float = 0.1,
        alpha: float = 0.5,
        available: Collection[Strategy] | None = None,
        expected_s: float | None = None,
        trust: float = 1.0,
    ) -> None:
        if kind not in LADDERS:
            raise ValueError(f"kind must be one of {sorted(LADDERS)}, got {kind!r}")
        if not (math.isfinite(healthy_iteration_s) and healthy_iteration_s > 0):
            raise ValueError(f"healthy_iteration_s must be positive, got {healthy_iteration_s!r}")
        if not (tolerance >= 0 and 0 < alpha <= 1):
            raise ValueError(f"need tolerance >= 0 and 0 < alpha <= 1, got {tolerance!r}, {alpha!r}")
        if not 0 < trust <= 1:
            raise ValueError(f"trust must be in (0, 1], got {trust!r}")
        if expected_s is not None and not (math.isfinite(expected_s) and expected_s > 0):
            raise ValueError(f"expected_s must be positive seconds or None, got {expected_s!r}")
        ladder = [s for s in LADDERS[kind] if available is None or s in available or s is Strategy.IGNORE]
        for s in ladder[1:]:
            if s not in overheads_s or not (overheads_s[s] >= 0 and math.isfinite(overheads_s[s])):
                raise ValueError(f"overheads_s: {s.name} needs a finite overhead >= 0 in seconds")
        self.kind = kind
        self.healthy_s = float(healthy_iteration_s)
        self.tolerance = float(tolerance)
        self.alpha = float(alpha)
        self.expected_s = None if expected_s is None else float(expected_s)
        self.trust = float(trust)
        self.ladder = tuple(ladder)
        self._overheads = {s: float(overheads_s[s]) for s in ladder[1:]}
        self._step = 0
        self._pending: Strategy | None = None
        self.loss_s = 0.0
        self.slow_iterations = 0
        self.closed = False

    @property
    def strategy(self) -> Strategy:
        return self.ladder[self._step]

    @property
    def overheads(self) -> dict[Strategy, float]:
        return dict(self._overheads)

    @property
    def pending(self) -> Strategy | None:
        return self._pending

    def observe(self, iteration_s: float) -> Decision | None:
        """One iteration's time; returns the decision it triggers, if any."""
        if self.closed:
            return None
        if not (math.isfinite(iteration_s) and iteration_s >= 0):
            raise ValueError(f"iteration time must be finite and >= 0, got {iteration_s!r}")
        if iteration_s <= self.healthy_s * (1.0 + self.tolerance):
            return None  # not slow: the current strategy (or the fault's end) brought the job back
        self.loss_s += iteration_s - self.healthy_s
        self.slow_iterations += 1
        if self._pending is not None or self._step + 1 >= len(self.ladder):
            return None
        nxt = self.ladder[self._step + 1]
        price = self._overheads[nxt]
        outlasts = self._outlasts(price, (iteration_s - self.healthy_s) / iteration_s)
        threshold = (price if self.expected_s is None else
                     price * self.trust if outlasts else price / self.trust)
        if self.loss_s < threshold:
            return None
        was = self.strategy
        self._step += 1
        self._pending = nxt
        bar = f"{nxt.name}'s overhead {price:.1f} s"
        if self.expected_s is not None and self.trust != 1.0:
            bar = (f"{self.trust:g} x {bar} (a {self.kind} fail-slow is expected to last "
                   f"{self.expected_s:.0f} s, past the break-even)" if outlasts else
                   f"{bar} / {self.trust:g} (a {self.kind} fail-slow is expected to end before "
                   f"the break-even)")
        return Apply(nxt, self.loss_s, price,
                     f"loss {self.loss_s:.1f} s over {self.slow_iterations} slow iterations reached "
                     f"{bar} and {was.name} has not brought the iteration back within "
                     f"{self.tolerance:.0%} of {self.healthy_s:.3f} s", threshold)

    def _outlasts(self, price: float, rate: float) -> bool:
        """Purohit et al.'s test, y >= b: the predicted duration against the break-even, the
        time at which the loss at the current rate (seconds lost per second of training) would
        pay ``price``. Decided on the prediction alone, not on the loss so far."""
        return self.expected_s is not None and self.expected_s * rate >= price

    def applied(self, strategy: Strategy, cost_s: float) -> None:
        """The plan for ``strategy`` is in force; it cost ``cost_s`` (updates the estimate)."""
        if strategy is not self._pending:
            raise ValueError(f"{strategy.name} was not awaiting application (pending: "
                             f"{self._pending.name if self._pending else None})")
        if not (math.isfinite(cost_s) and cost_s >= 0):
            raise ValueError(f"cost_s must be finite and >= 0, got {cost_s!r}")
        self._overheads[strategy] += self.alpha * (cost_s - self._overheads[strategy])
        self._pending = None

    def failed(self, strategy: Strategy) -> None:
        """Applying ``strategy`` failed: it no longer blocks the ladder, which moves past it."""
        if strategy is not self._pending:
            raise ValueError(f"{strategy.name} was not awaiting application")
        self._pending = None

    def state_dict(self) -> dict[str, Any]:
        """Everything the state machine holds, as JSON-able values (a restarted planner goes on
        with the loss it had counted)."""
        return {"kind": self.kind, "healthy_s": self.healthy_s, "tolerance": self.tolerance,
                "alpha": self.alpha, "expected_s": self.expected_s, "trust": self.trust,
                "ladder": [s.name for s in self.ladder],
                "overheads": {s.name: v for s, v in self._overheads.items()},
                "step": self._step, "pending": self._pending.name if self._pending else None,
                "loss_s": self.loss_s, "slow_iterations": self.slow_iterations,
                "closed": self.closed}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Escalation:
        """The inverse of :meth:`state_dict`; a ValueError for a state it cannot have written."""
        try:
            ladder = [Strategy[name] for name in state["ladder"]]
            overheads = {Strategy[k]: float(v) for k, v in state["overheads"].items()}
            esc = cls(state["kind"], float(state["healthy_s"]), overheads,
                      tolerance=float(state["tolerance"]), alpha=float(state["alpha"]),
                      available=ladder, expected_s=state.get("expected_s"),
                      trust=float(state.get("trust", 1.0)))
            step, pending = int(state["step"]), state["pending"]
            if tuple(ladder) != esc.ladder or not 0 <= step < len(ladder):
                raise ValueError(f"ladder {state['ladder']} / step {step} do not fit {state['kind']!r}")
            esc._step = step
            esc._pending = None if pending is None else Strategy[pending]
            esc.loss_s = float(state["loss_s"])
            esc.slow_iterations = int(state["slow_iterations"])
            esc.closed = bool(state["closed"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not an escalation state: {exc!r}") from exc
        return esc

    def recovered(self) -> Revert | None:
        """The fail-slow ended: revert the plan in force (if it can be) and close the incident."""
        if self.closed:
            return None
        self.closed = True
        current = self.strategy
        if current in (Strategy.MICROBATCH, Strategy.TOPOLOGY):
            return Revert(current, f"the fail-slow ended; {current.name}'s plan is undone")
        return None
