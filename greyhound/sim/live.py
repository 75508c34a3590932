"""Live mode: every simulated rank writes its hook ring in compressed virtual time.

The node agent drains these files exactly as it drains hooked processes: one ring per rank
under ``<shm_dir>/<job>/rank-<r>.ring``, host ``sim-node<N>``, device the local GPU index.
Record times are monotonic nanoseconds of a virtual clock (virtual second 0 = the monotonic and
wall times read at start, which are every ring's anchors), so the agent's wall times are
``start + virtual seconds``.

Each rank behaves like a training thread over a blocking NCCL: a record appears once its call
has returned by the virtual now, calls in enter order; the one call a rank is inside shows in
the comm table only (entered, sequence, op, enter time), which is how hangs look: a hung call
is entered and never returns, a call never entered changes no counter. The agent measures
``inflight`` against its own monotonic clock; ``inflight_enter_ns`` is therefore rescaled each
tick so that it reads the virtual time spent inside.

Pacing: ``speed`` caps virtual seconds per wall second; without it the run goes as fast as the
agent consumes (never more than ``lead`` x capacity records ahead of any rank's consumed cursor).
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from greyhound import hookabi
from greyhound.sim import livectl
from greyhound.sim.model import ClusterModel
from greyhound.sim.records import RecordCodec, comm_ids
from greyhound.sim.ringwriter import CommRow, Inflight, SimRing
from greyhound.sim.scenario import Scenario

_JOB_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_PROFILED = int(hookabi.Flag.PROFILED | hookabi.Flag.GPU_DONE)


@dataclass(frozen=True, slots=True)
class LiveProgress:
    virtual_s: float
    iterations: int
    wall_s: float
    records: int
    dropped: int
    hung: bool

    @property
    def speed(self) -> float:
        return self.virtual_s / self.wall_s if self.wall_s > 0 else 0.0


class LiveSimulation:
    """Plays every rank of a scenario into ring files; call :meth:`run` (or :meth:`step`)."""

    def __init__(self, scenario: Scenario, shm_dir: Path, job_id: str, *,
                 speed: float | None = None, capacity: int = 4096, lead: float = 0.25,
                 max_ahead_s: float = 1.0, chunk_iterations: int = 4, tick_s: float = 0.02,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not _JOB_ID.match(job_id):
            raise ValueError(f"job id {job_id!r} must match [A-Za-z0-9_-]{{1,128}}")
        if speed is not None and speed <= 0:
            raise ValueError("speed must be positive")
        self.scenario = scenario
        self.model = model = ClusterModel(scenario)
        self.job_id = job_id
        self.speed = speed
        self.lead = lead
        # A real agent drains every few tens of ms, so what it reads is at most that old; a
        # simulation far ahead of its reader would hand the analyzer stale calls (from before
        # a fault began) when it profiles. Virtual time written and not yet read stays small.
        self.max_ahead_s = max_ahead_s
        self._written_at: collections.deque[tuple[float, list[int]]] = collections.deque()
        self.chunk_iterations = chunk_iterations
        self.tick_s = tick_s
        self._clock = clock
        self.dir = Path(shm_dir) / job_id
        self.mono0_ns = time.monotonic_ns()
        self.wall0_ns = time.time_ns()
        self.codec = RecordCodec(model.comms, self.mono0_ns, pid=os.getpid())
        self.rings = [self._ring(r, capacity) for r in range(scenario.job.world)]
        self._rng = np.random.default_rng(scenario.seed + 1)
        world = scenario.job.world
        self._rank = np.zeros(0, dtype=np.int64)
        self._rec = np.zeros(0, dtype=hookabi.RECORD_DTYPE)
        self._ends: list[float] = []  # virtual end time of each simulated iteration
        self._model_t = 0.0
        self._v = 0.0
        self._written = 0
        self._parked: dict[int, int] = {}  # rank -> enter_ns of the call it is parked at
        self._released: set[int] = set()
        self._profile = np.zeros(world, dtype=bool)
        self._start = self._last = clock()
        self.samples: list[tuple[int, float]] = [(self.wall0_ns, 0.0)]  # (wall ns, virtual s)

    def _ring(self, rank: int, capacity: int) -> SimRing:
        job, comms = self.scenario.job, self.model.comms
        ids = comm_ids(comms)
        tp, dp, pp = job.tp, job.dp, job.pp
        t, d, s = rank % tp, (rank // tp) % dp, rank // (tp * dp)
        peers = tuple(p for p in (s - 1, s + 1) if 0 <= p < pp)
        rows = [
            CommRow(int(ids[s * dp + d]), t, tp),
            CommRow(int(ids[comms.dp_base + s * tp + t]), d, dp),
            CommRow(int(ids[comms.pp_base + d * tp + t]), s, pp, peers),
        ]
        gpu = int(self.model.layout.gpu_of_rank[rank])
        return SimRing(hookabi.ring_path(self.dir.parent, self.job_id, rank), job=self.job_id,
                       rank=rank, host=f"sim-node{gpu // job.gpus_per_node}", pid=os.getpid(),
                       device=gpu % job.gpus_per_node, capacity=capacity,
                       mono_anchor_ns=self.mono0_ns, wall_anchor_ns=self.wall0_ns, comms=rows)

    # ---- progress ---------------------------------------------------------------------------

    @property
    def virtual_s(self) -> float:
        return self._v

    @property
    def done(self) -> bool:
        return self._v >= self.scenario.duration_s

    def progress(self) -> LiveProgress:
        its = int(np.searchsorted(np.asarray(self._ends), self._v, side="right"))
        return LiveProgress(self._v, its, self._clock() - self._start, self._written,
                            sum(r.dropped for r in self.rings), self.model.hung)

    def virtual_at(self, wall_ns: int) -> float:
        """The virtual time the run had reached at a wall-clock instant (for reporting)."""
        w, v = np.array(self.samples, dtype=np.float64).T
        return float(np.interp(float(wall_ns), w, v))

    def run(self, *, on_progress: Callable[[LiveProgress], None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> LiveProgress:
        while not self.done and not (should_stop is not None and should_stop()):
            if not self.step() or self.speed is not None:
                time.sleep(self.tick_s)
            if on_progress is not None:
                on_progress(self.progress())
        if self.done:
            for ring in self.rings:
                ring.finish()
        return self.progress()

    # ---- one tick ---------------------------------------------------------------------------

    def step(self) -> bool:
        """Advance the virtual clock once; False when held back (agent behind, nothing to do)."""
        now = self._clock()
        dt, self._last = now - self._last, now
        self._control()
        if (max(r.lag() for r in self.rings) > self.lead * self.rings[0].capacity
                or self._unread_virtual_s() > self.max_ahead_s):
            self._restamp()
            return False
        target = self._target(dt)
        if target <= self._v:
            self._restamp()
            return False
        self._fill(target)
        self._write(target)
        self._v = target
        self.samples.append((time.time_ns(), target))
        self._written_at.append((target, [r.head for r in self.rings]))
        return True

    def _unread_virtual_s(self) -> float:
        """Virtual seconds between now and the oldest step whose records are not all read."""
        while self._written_at:
            start, heads = self._written_at[0]
            if all(r.consumed >= h for r, h in zip(self.rings, heads, strict=True)):
                self._written_at.popleft()
                continue
            return self._v - start
        return 0.0

    def _restamp(self) -> None:
        mono_now, v_ns = time.monotonic_ns(), int(self.codec.ns(np.array([self._v]))[0])
        for ring in self.rings:
            ring.restamp(mono_now, v_ns)

    def _target(self, dt: float) -> float:
        end = self.scenario.duration_s
        if self.speed is not None:
            return min(end, self._v + self.speed * dt)
        if self.model.hung or self._parked:
            # Nothing moves but the clock: keep the pace the run has had (at least real time).
            rate = max(1.0, self._v / max(self._last - self._start, 1e-9))
            return min(end, self._v + rate * dt)
        ahead = [e for e in self._ends if e > self._v][: self.chunk_iterations]
        if len(ahead) < self.chunk_iterations:
            self._fill(self._v + 1e-9, self.chunk_iterations - len(ahead))
            ahead = [e for e in self._ends if e > self._v][: self.chunk_iterations]
        return min(end, ahead[-1] if ahead and np.isfinite(ahead[-1]) else self._v + dt)

    def _fill(self, target: float, at_least: int = 0) -> None:
        """Simulate iterations until the pending records cover ``target``."""
        n = 0
        while (self._model_t <= target or n < at_least) and not self.model.hung \
                and not self._parked and self._model_t < self.scenario.duration_s:
            it = self.model.iteration(self._model_t)
            ranks, recs = self.codec.encode(it.blocks)
            self._ends.append(it.end_s)
            self._model_t = it.end_s
            n += 1
            if len(recs):
                rank = np.concatenate((self._rank, ranks))
                rec = np.concatenate((self._rec, recs))
                order = np.lexsort((rec["enter_ns"], rank))
                self._rank, self._rec = rank[order], rec[order]

    def _write(self, target: float) -> None:
        world = len(self.rings)
        v_ns = int(self.codec.ns(np.array([target]))[0])
        rank, rec = self._rank, self._rec
        starts = np.searchsorted(rank, np.arange(world))
        ends = np.searchsorted(rank, np.arange(world), side="right")
        pos = np.arange(len(rec))
        parked_at = self._parked_index(starts, ends)
        self._park_new(rec, starts, ends, v_ns, parked_at)
        bad = np.where(rec["return_ns"] > np.uint64(v_ns), pos, len(rec))
        first = ends.copy()
        nonempty = np.flatnonzero(ends > starts)
        if nonempty.size:
            first[nonempty] = np.minimum(np.minimum.reduceat(bad, starts[nonempty]),
                                         ends[nonempty])
        if parked_at:
            first = np.minimum(first, livectl.blocked_from(rank, rec, starts, ends, parked_at))
        mono_now = time.monotonic_ns()
        for r in range(world):
            s, k = int(starts[r]), int(first[r])
            out = rec[s:k]
            if self._profile[r] and len(out):
                out = out.copy()
                out["flags"] |= _PROFILED
                out["gpu_start_ns"] = out["enter_ns"]
                out["gpu_end_ns"] = out["return_ns"]
            call, shown = None, 0
            if k < ends[r] and k != parked_at.get(r) and int(rec["enter_ns"][k]) <= v_ns:
                row = self.rings[r].rows[int(rec["comm_id"][k])]
                enter = int(rec["enter_ns"][k])
                call = Inflight(row, int(rec["op"][k]), int(rec["seq"][k]), enter,
                                int(rec["count"][k]), int(rec["datatype"][k]))
                shown = mono_now - (v_ns - enter)
            self.rings[r].advance(out, call, shown)
        taken = first - starts
        keep = (pos - starts[rank]) >= taken[rank]
        self._written += len(rec) - int(keep.sum())
        self._rank, self._rec = rank[keep], rec[keep]

    # ---- control blocks ---------------------------------------------------------------------

    def _control(self) -> None:
        for r, ring in enumerate(self.rings):
            ctl = ring.control
            self._profile[r] = ctl.mode == "profile"
            if r in self._parked and r not in self._released:
                if ctl.pause_requested():
                    livectl.answer_requests(ctl, self.model, r, self._v, self._rng)
                else:
                    ctl.set_paused(False)
                    self._released.add(r)
        if self._parked and self._released >= set(self._parked):
            self._resume()

    def _park_new(self, rec: np.ndarray, starts: np.ndarray, ends: np.ndarray, v_ns: int,
                  parked_at: dict[int, int]) -> None:
        """Ranks asked to pause park at the target call once the clock reaches its entry."""
        entered_ns = int(self.codec.ns(np.array([self._v]))[0])
        for r, ring in enumerate(self.rings):
            ctl = ring.control
            if r in self._parked or not ctl.pause_requested():
                continue
            comm, seq = ctl.pause_target()
            i = livectl.park_index(rec[starts[r]:ends[r]], comm, seq, entered_ns)
            if i is None or int(rec["enter_ns"][starts[r] + i]) > v_ns:
                continue
            at = int(starts[r] + i)
            self._parked[r] = int(rec["enter_ns"][at])
            parked_at[r] = at
            ctl.set_paused(True, tid=os.getpid())

    def _parked_index(self, starts: np.ndarray, ends: np.ndarray) -> dict[int, int]:
        """Absolute index of the call each parked rank is parked at (still pending)."""
        enter = self._rec["enter_ns"]
        return {r: int(starts[r] + np.searchsorted(enter[starts[r]:ends[r]], np.uint64(ns)))
                for r, ns in self._parked.items()}

    def _resume(self) -> None:
        """Everything the pause held back happens later by the pause's virtual length: calls
        not entered yet enter later, calls waiting inside NCCL return later."""
        since_ns = min(self._parked.values())
        since = (since_ns - self.mono0_ns) / 1e9
        delay = max(0.0, self._v - since)
        rank, rec = self._rank, self._rec
        world = np.arange(len(self.rings))
        starts = np.searchsorted(rank, world)
        ends = np.searchsorted(rank, world, side="right")
        parked_at = self._parked_index(starts, ends)
        first = livectl.blocked_from(rank, rec, starts, ends, parked_at)
        park = ends.copy()
        for r, i in parked_at.items():
            park[r] = i
        pos = np.arange(len(rec))
        held = pos >= first[rank]
        v_ns = np.uint64(self.mono0_ns + round(self._v * 1e9))
        waiting = (pos == first[rank]) & (rec["enter_ns"] <= v_ns) & (pos < park[rank])
        d_ns = np.uint64(round(delay * 1e9))
        rec["enter_ns"][held & ~waiting] += d_ns
        rec["return_ns"][held] += d_ns
        rec["return_ns"] = np.maximum(rec["return_ns"], rec["enter_ns"])
        self._ends = [e + delay if e > since else e for e in self._ends]
        self._model_t += delay
        order = np.lexsort((rec["enter_ns"], rank))
        self._rank, self._rec = rank[order], rec[order]
        self._parked.clear()
        self._released.clear()

    def close(self, *, remove: bool = False) -> None:
        for ring in self.rings:
            ring.close()
        shutil.rmtree(self.dir / ".staging", ignore_errors=True)
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)
