"""How fast a live simulation may run: virtual seconds per wall second, decided step by step.

The services take wall-clock time for some of their work (an analyzer's profiling window, a
validation's pause, a plan's delivery), and at N x that work lasts N times longer in the job's
virtual time: at 5x a 3 s validation pause is 15 virtual seconds of a stopped job. Iteration
counts do not depend on the pace (the tracker's change points are in iterations), but a tracker
that falls behind its telemetry sees the job late, and a run that ends before the services have
read it reports a healthy job. So the pace is chosen from what is going on:

* ``slow`` (1x, real time) from ``lead_s`` before each fault's onset until its reaction is over
  (the driver calls :meth:`Pacer.settle`, or ``window_s`` passed), so reaction times are read at
  real time; likewise from ``lead_s`` before each fault's end until the services have taken
  back what they did for it (:meth:`Pacer.settle_end`; a plan in force after its fault ended
  slows the healthy job, and its revert waits on wall-clock re-checks); and whenever the
  services work on the job (profiling, a pause): ``busy``;
* ``fast`` otherwise;
* either one lowered while the tracker lags (``lag`` messages not yet consumed above
  ``lag_high``: the factor halves, down to ``min_factor``; below ``lag_low`` it grows back).

The pacer only decides; it reads no clock and touches no file. :meth:`Pacer.report` says how
the run was paced: wall and virtual seconds spent in each mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

Mode = Literal["reaction", "busy", "fast"]
MODES: tuple[Mode, ...] = ("reaction", "busy", "fast")


@dataclass(frozen=True, slots=True)
class PacePolicy:
    fast: float = 4.0
    slow: float = 1.0
    lead_s: float = 3.0
    window_s: float = 60.0
    lag_high: int = 200
    lag_low: int = 50
    min_factor: float = 0.125
    adjust_every_s: float = 1.0  # wall seconds between two changes of the lag factor

    def __post_init__(self) -> None:
        if not (self.fast > 0 and self.slow > 0):
            raise ValueError("paces must be positive")
        if self.lead_s < 0 or self.window_s <= 0:
            raise ValueError("lead_s must be >= 0 and window_s > 0")
        if not 0 <= self.lag_low <= self.lag_high:
            raise ValueError("need 0 <= lag_low <= lag_high")
        if not 0 < self.min_factor <= 1:
            raise ValueError("min_factor must be in (0, 1]")


@dataclass(slots=True)
class ModeTime:
    wall_s: float = 0.0
    virtual_s: float = 0.0

    @property
    def speed(self) -> float | None:
        return self.virtual_s / self.wall_s if self.wall_s > 0 else None


@dataclass(frozen=True, slots=True)
class PaceReport:
    """Where the run's wall time went; ``lagged_s``: wall seconds held back by the tracker."""

    modes: dict[Mode, ModeTime]
    lagged_s: float
    policy: PacePolicy

    def describe(self) -> str:
        parts = []
        names = {"reaction": f"{self.policy.slow:g}x from {self.policy.lead_s:g} s before each "
                             f"fault until the services' reaction to it was over (at most "
                             f"{self.policy.window_s:g} s), and before its end until its plan "
                             "was taken back",
                 "busy": f"{self.policy.slow:g}x while the services profiled or paused the job "
                         "or a plan was on its way to it",
                 "fast": f"up to {self.policy.fast:g}x otherwise"}
        for m in MODES:
            t = self.modes[m]
            got = f", achieved {t.speed:.2f}x" if t.speed is not None else ""
            parts.append(f"{names[m]}: {t.virtual_s:.0f} virtual s in {t.wall_s:.0f} wall s{got}")
        text = "; ".join(parts)
        if self.lagged_s > 0:
            text += f"; held back {self.lagged_s:.0f} wall s by the tracker's lag"
        return text


@dataclass
class Pacer:
    """``onsets``: each fault's start in virtual seconds (the driver knows the schedule; the
    services never see it)."""

    policy: PacePolicy
    onsets: Sequence[float] = ()
    ends: Sequence[float] = ()  # each fault's end (virtual s), in the onsets' order
    settled: set[int] = field(default_factory=set)
    ended: set[int] = field(default_factory=set)  # faults whose end needs no more reaction
    factor: float = 1.0
    _mode: Mode = "fast"
    _last: tuple[float, float] | None = None  # (virtual, wall) of the previous call
    _times: dict[Mode, ModeTime] = field(default_factory=lambda: {m: ModeTime() for m in MODES})
    _lagged_s: float = 0.0
    _adjusted_at: float = float("-inf")

    def settle(self, fault: int) -> None:
        """Fault ``fault``'s reaction is over: the pace need not stay slow for it."""
        self.settled.add(fault)

    def settle_end(self, fault: int) -> None:
        """What the services did for fault ``fault`` is taken back (or there was nothing): the
        pace need not stay slow at its end."""
        self.ended.add(fault)

    def ending(self, virtual_s: float) -> list[int]:
        """Faults whose end's reaction window is open at ``virtual_s``."""
        p = self.policy
        return [i for i, t in enumerate(self.ends) if i not in self.ended
                and t - p.lead_s <= virtual_s < t + p.window_s]

    def reacting(self, virtual_s: float) -> list[int]:
        """Faults whose reaction window is open at ``virtual_s``."""
        p = self.policy
        return [i for i, t in enumerate(self.onsets) if i not in self.settled
                and t - p.lead_s <= virtual_s < t + p.window_s]

    def speed(self, virtual_s: float, wall_s: float, *, busy: bool = False,
              lag: int | None = None) -> float:
        """The pace from now on; call it every step with the run's virtual and wall time."""
        p = self.policy
        if self._last is not None:
            dv, dw = virtual_s - self._last[0], wall_s - self._last[1]
            t = self._times[self._mode]
            t.virtual_s += max(dv, 0.0)
            t.wall_s += max(dw, 0.0)
            if self.factor < 1.0:
                self._lagged_s += max(dw, 0.0)
        self._last = (virtual_s, wall_s)
        if wall_s - self._adjusted_at >= p.adjust_every_s:
            self._adjusted_at = wall_s
            if lag is not None and lag > p.lag_high:
                self.factor = max(p.min_factor, self.factor / 2)
            elif lag is None or lag < p.lag_low:
                self.factor = min(1.0, self.factor * 1.25)
        if self.reacting(virtual_s) or self.ending(virtual_s):
            self._mode = "reaction"
        elif busy:
            self._mode = "busy"
        else:
            self._mode = "fast"
        base = p.fast if self._mode == "fast" else p.slow
        return base * self.factor

    @property
    def mode(self) -> Mode:
        return self._mode

    def report(self) -> PaceReport:
        return PaceReport({m: ModeTime(t.wall_s, t.virtual_s) for m, t in self._times.items()},
                          self._lagged_s, self.policy)
