"""Live mode: every simulated rank writes its hook ring in compressed virtual time.

The node agent drains these files exactly as it drains hooked processes: one ring per rank
under ``<shm_dir>/<job>/rank-<r>.ring``, host ``sim-node<N>``, device the local GPU index.
Record times are monotonic nanoseconds of a virtual clock (virtual second 0 = the monotonic and
wall times read at start, which are every ring's anchors), so the agent's wall times are
``start + virtual seconds``.

Each rank behaves like a training process over an asynchronous NCCL on a GPU: its host enqueues
an iteration's calls up front, microseconds each, and waits in the iteration's synchronisation
outside NCCL; its GPU runs them later. A record appears once the host returned from its call, in
enqueue order; in profile mode (decided when the call is enqueued) once its GPU times are known,
as the agent's reader would hand it out, or after the reader's wait without them
(``hookabi.profile_wait_s``: several recent iterations, at least two seconds). A record published
untimed would be held by the reader until its wall clock passed the record's return plus that
wait, and the virtual clock runs ahead of the wall clock whenever the pace is above 1x: the run
would stand still (its unread records) until the wall clock caught up. So a record whose wait is
over goes out as the reader would hand it out by then, settled without GPU times (GPU_LOST). The
comm table moves as the hook moves it (:mod:`greyhound.sim.commtable`): host counters at enqueue
and return, completion marks as the GPU completes calls. A hang is a call pending on a GPU while
every host sits outside NCCL; a call never enqueued moves no host counter.

The agent ages ``inflight_enter_ns`` and ``gpu_pending_ns`` against its own monotonic clock, so
both are rescaled each tick to read the virtual time elapsed since (see ``CommTables.shown``).

Pacing: ``speed`` caps virtual seconds per wall second; without it the run goes as fast as the
agent consumes (never more than ``lead`` x capacity records ahead of any rank's consumed cursor).

Plans: :meth:`LiveSimulation.submit` hands the job a mitigation (greyhound.core.plans); it
takes effect at the next iteration the simulation has not computed yet, which starts later by
the plan's modelled cost (a re-balance costs little, a topology change is a pause, as in the
scenario's ``costs``), and :meth:`LiveSimulation.applied` says when and at what cost.

A paced step moves the clock by at most ``speed`` x ``max_step_s``: wall time lost to a stall
(the driver's callbacks, a loaded machine) is not made up in one leap. A leap writes a burst of
records whose simulation and writing take longer still, so the next leap is larger; meanwhile
the clock keeper cannot restamp (pending GPU calls look hung), pause requests wait for the step
to end, and the agents' readers get many seconds of calls at once. On a loaded machine the run
falls behind ``speed`` instead, and everything that reads it sees a consistent job.
"""

from __future__ import annotations

import collections
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from greyhound import hookabi
from greyhound.core.plans import Plan, PlanError
from greyhound.hookabi import BenchRequest, BenchState, CommRow, RingWriter
from greyhound.ids import check_token
from greyhound.sim import livectl
from greyhound.sim.commtable import CommTables, Progress
from greyhound.sim.model import ClusterModel
from greyhound.sim.records import NEVER_NS, RecordCodec, comm_ids
from greyhound.sim.scenario import Scenario

_PROFILED = np.uint32(hookabi.Flag.PROFILED)
_GPU_DONE = np.uint32(hookabi.Flag.GPU_DONE)
_GPU_LOST = np.uint32(hookabi.Flag.GPU_LOST)
RECENT_ITERATIONS = 8  # iterations the agent's wait for GPU times looks back on (its collector)
DRAIN_TIMEOUT_S = 10.0  # a parked rank measures anyway if its queued GPU work cannot finish


@dataclass(frozen=True, slots=True)
class AppliedPlan:
    """A submitted plan in force: from the iteration starting at ``virtual_s`` (after its pause
    of ``cost_s``); ``tag`` is the submitter's (e.g. the delivery version)."""

    tag: int
    virtual_s: float
    cost_s: float
    iteration: int
    error: str | None = None  # the job could not apply it (greyhound.core.plans.PlanError)


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
                 max_step_s: float = 0.1, clock: Callable[[], float] = time.monotonic) -> None:
        check_token(job_id, "job id")
        if speed is not None and speed <= 0:
            raise ValueError("speed must be positive")
        if max_step_s <= 0:
            raise ValueError("max_step_s must be positive")
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
        self.max_step_s = max_step_s
        self._clock = clock
        self.dir = Path(shm_dir) / job_id
        self.mono0_ns = time.monotonic_ns()
        self.wall0_ns = time.time_ns()
        self.codec = RecordCodec(model.comms, self.mono0_ns, pid=os.getpid())
        self.rings = [self._ring(r, capacity) for r in range(scenario.job.world)]
        self.tables = CommTables(np.stack([ring.rows() for ring in self.rings]))
        self._rng = np.random.default_rng(scenario.seed + 1)
        world = scenario.job.world
        # Calls not yet retired (published and done on the GPU), by rank then in enqueue order.
        self._rank = np.zeros(0, dtype=np.int64)
        self._rec = np.zeros(0, dtype=hookabi.RECORD_DTYPE)
        self._iter = np.zeros(0, dtype=np.int64)  # the iteration each call belongs to
        self._state = np.zeros(0, dtype=np.uint8)  # Progress bits
        self._ends: list[float] = []  # virtual end time of each simulated iteration
        self._model_t = 0.0
        self._v = 0.0
        self._written = 0
        self._parked: dict[int, int] = {}  # rank -> enter_ns of the call it is parked at
        self._released: set[int] = set()
        self._drained: dict[int, float] = {}  # parked rank -> when its queued GPU work is done
        self._benches: dict[int, list[tuple[int, BenchRequest, float]]] = {}  # (id, req, seen)
        self._profile = np.zeros(world, dtype=bool)
        self._start = self._last = clock()
        self._lock = threading.Lock()  # run()'s clock keeper restamps between steps
        self._shown_at = time.monotonic()
        self.samples: list[tuple[int, float]] = [(self.wall0_ns, 0.0)]  # (wall ns, virtual s)
        self._submitted: collections.deque[tuple[int, list[Plan]]] = collections.deque()
        self._applied: list[AppliedPlan] = []
        self._starts: list[float] = []  # virtual start of each simulated iteration

    def _ring(self, rank: int, capacity: int) -> RingWriter:
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
        return RingWriter(hookabi.ring_path(self.dir.parent, self.job_id, rank), job=self.job_id,
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

    @property
    def attended(self) -> bool:
        """The services work on the job right now: a rank profiled or asked to pause (their
        wall-clock work that a pacer keeps at real time)."""
        return any(r.control.mode == "profile" or r.control.pause_requested() for r in self.rings)

    def submit(self, tag: int, plans: list[Plan]) -> None:
        """Apply ``plans`` (in order, as one change) at the next iteration boundary the
        simulation reaches; safe to call from the driver's callbacks."""
        self._submitted.append((tag, list(plans)))

    def applied(self) -> list[AppliedPlan]:
        """Plans that took effect since the last call."""
        out, self._applied = self._applied, []
        return out

    def iteration_times(self) -> list[tuple[float, float]]:
        """(virtual start, duration) of every simulated iteration so far, pauses included."""
        return [(s, e - s) for s, e in zip(self._starts, self._ends, strict=False)]

    def virtual_at(self, wall_ns: int) -> float:
        """The virtual time the run had reached at a wall-clock instant (for reporting)."""
        w, v = np.array(self.samples, dtype=np.float64).T
        return float(np.interp(float(wall_ns), w, v))

    def run(self, *, on_progress: Callable[[LiveProgress], None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> LiveProgress:
        stop = threading.Event()
        keeper = threading.Thread(target=self._keep_clock, args=(stop,), daemon=True,
                                  name="sim-clock")
        keeper.start()
        try:
            while not self.done and not (should_stop is not None and should_stop()):
                with self._lock:
                    moved = self.step()
                if not moved or self.speed is not None:
                    time.sleep(self.tick_s)
                if on_progress is not None:
                    on_progress(self.progress())
        finally:
            stop.set()
            keeper.join()
        if self.done:
            self.finish()
        return self.progress()

    def _keep_clock(self, stop: threading.Event) -> None:
        """While the driver is away (its callbacks may block on I/O for seconds), the virtual
        clock stands still: restamp so that the ages the agent reads do not run on wall time
        (nearly every rank has a call pending on its GPU at any moment; a stall would read as a
        hang)."""
        interval = max(self.tick_s, 0.02)
        while not stop.wait(interval):
            if time.monotonic() - self._shown_at > interval:
                with self._lock:
                    self._restamp()

    def finish(self) -> None:
        """The simulated job ended: nothing is inside NCCL or pending on a GPU any more (as when
        the processes exit), so the end of a run never looks like a hang."""
        self.tables.clear()
        self._show(int(self.codec.ns(np.array([self._v]))[0]))

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
        """Keep the clocks the agent ages against reading virtual time while the run stands
        still (held back by its consumer): a paced simulation must not look hung."""
        self._show(int(self.codec.ns(np.array([self._v]))[0]))

    def _show(self, v_ns: int) -> None:
        rows = self.tables.shown(time.monotonic_ns(), v_ns)
        for r, ring in enumerate(self.rings):
            ring.set_rows(rows[r])
        self._shown_at = time.monotonic()

    def _target(self, dt: float) -> float:
        end = self.scenario.duration_s
        if self.speed is not None:
            return min(end, self._v + self.speed * min(dt, self.max_step_s))
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
        """Simulate iterations until the pending records cover ``target``; they join the
        pending ones in a single sort (one per iteration costs the square of a long step)."""
        n = 0
        new: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        while (self._model_t <= target or n < at_least) and not self.model.hung \
                and not self._parked and self._model_t < self.scenario.duration_s:
            self._apply_submitted()
            self._starts.append(self._model_t)
            it = self.model.iteration(self._model_t)
            ranks, recs = self.codec.encode(it.blocks)
            self._ends.append(it.end_s)
            self._model_t = it.end_s
            n += 1
            if len(recs):
                new.append((ranks, recs, np.full(len(recs), it.index, dtype=np.int64)))
        if not new:
            return
        rank = np.concatenate((self._rank, *(x[0] for x in new)))
        rec = np.concatenate((self._rec, *(x[1] for x in new)))
        order = np.lexsort((rec["gpu_start_ns"], rec["enter_ns"], rank))
        self._rank, self._rec = rank[order], rec[order]
        self._iter = np.concatenate((self._iter, *(x[2] for x in new)))[order]
        added = sum(len(x[1]) for x in new)
        self._state = np.concatenate((self._state, np.zeros(added, np.uint8)))[order]

    def _apply_submitted(self) -> None:
        """Plans submitted since: in force from the iteration about to be simulated, which
        starts after their modelled cost (greyhound.sim.mitigation.apply)."""
        while self._submitted:
            tag, plans = self._submitted.popleft()
            cost, error = 0.0, None
            try:
                for p in plans:
                    cost += self.model.apply_plan(p)
            except PlanError as exc:
                error = str(exc)
            self._model_t += cost
            self._applied.append(AppliedPlan(tag, self._model_t, cost, len(self._ends), error))

    def gpu_wait_s(self) -> float:
        """How long the agent's reader waits for a profiled call's GPU times now: by its rule,
        on the longest of the last RECENT_ITERATIONS iterations the job completed."""
        done = int(np.searchsorted(np.asarray(self._ends), self._v, side="right"))
        recent = [e - s for s, e in zip(self._starts[max(0, done - RECENT_ITERATIONS):done],
                                        self._ends[max(0, done - RECENT_ITERATIONS):done],
                                        strict=True)]
        return hookabi.profile_wait_s(max(recent, default=0.0))

    def _segments(self) -> tuple[np.ndarray, np.ndarray]:
        world = np.arange(len(self.rings))
        return (np.searchsorted(self._rank, world), np.searchsorted(self._rank, world, "right"))

    def _write(self, target: float) -> None:
        """Move every rank to virtual time ``target``: count what its host enqueued and returned
        from and what its GPU completed, publish the records that are due, retire the rest."""
        v_ns = np.uint64(self.codec.ns(np.array([target]))[0])
        rank, rec = self._rank, self._rec
        starts, ends = self._segments()
        pos = np.arange(len(rec))
        parked_at = self._parked_index(starts, ends)
        host_stop, gpu_stop = self._stops(starts, ends, parked_at)
        if self._park_new(starts, ends, int(v_ns), host_stop, parked_at):
            host_stop, gpu_stop = self._stops(starts, ends, parked_at)
        state = self._state
        entered = (state & Progress.ENTERED != 0) \
            | ((pos < host_stop[rank]) & (rec["enter_ns"] <= v_ns))
        returned = (state & Progress.RETURNED != 0) | (entered & (rec["return_ns"] <= v_ns))
        finished = (state & Progress.DONE != 0) \
            | (entered & (pos < gpu_stop[rank]) & (rec["gpu_end_ns"] <= v_ns))
        new_in = entered & (state & Progress.ENTERED == 0) & self._profile[rank]
        state = state | np.where(new_in, np.uint8(Progress.PROFILED), np.uint8(0))
        state = self.tables.update(rank, rec, state, entered=entered, returned=returned,
                                   finished=finished)
        self._drain_times(starts, parked_at, gpu_stop, state)
        state = self._publish(starts, ends, state, v_ns)
        keep = (state & Progress.PUBLISHED == 0) | (state & Progress.DONE == 0)
        self._rank, self._rec = rank[keep], rec[keep]
        self._iter, self._state = self._iter[keep], state[keep]
        self._show(int(v_ns))

    def _publish(self, starts: np.ndarray, ends: np.ndarray, state: np.ndarray,
                 v_ns: np.uint64) -> np.ndarray:
        """Write each rank's records up to its first one not due: not returned yet, or profiled
        and neither done on the GPU nor returned the reader's wait ago (gpu_wait_s)."""
        rank, rec = self._rank, self._rec
        pos = np.arange(len(rec))
        profiled = state & Progress.PROFILED != 0
        done = state & Progress.DONE != 0
        waited = rec["return_ns"] <= v_ns - np.uint64(round(self.gpu_wait_s() * 1e9))
        due = (state & Progress.RETURNED != 0) & (~profiled | done | waited)
        unpublished = state & Progress.PUBLISHED == 0
        blocker = np.where(unpublished & ~due, pos, len(rec))
        first = ends.copy()
        nonempty = np.flatnonzero(ends > starts)
        if nonempty.size:
            first[nonempty] = np.minimum(np.minimum.reduceat(blocker, starts[nonempty]),
                                         ends[nonempty])
        go = unpublished & (pos < first[rank])
        out = rec[go]
        timed = profiled[go] & done[go]
        # Untimed after the reader's wait: GPU_LOST, as the reader would hand it out by then.
        # Plainly untimed, a reader on the wall clock would wait for the virtual return plus
        # its wait, and the run would stand still (unread) until the wall clock got there.
        out["flags"] |= np.where(profiled[go], _PROFILED, np.uint32(0)) \
            | np.where(timed, _GPU_DONE, np.where(profiled[go], _GPU_LOST, np.uint32(0)))
        out["gpu_start_ns"] = np.where(timed, out["gpu_start_ns"], np.uint64(0))
        out["gpu_end_ns"] = np.where(timed, out["gpu_end_ns"], np.uint64(0))
        bounds = np.searchsorted(rank[go], np.arange(len(self.rings) + 1))
        for r in np.flatnonzero(np.diff(bounds)).tolist():
            self.rings[r].append(out[bounds[r]:bounds[r + 1]])
        self._written += len(out)
        return state | np.where(go, np.uint8(Progress.PUBLISHED), np.uint8(0))

    # ---- control blocks ---------------------------------------------------------------------

    def _control(self) -> None:
        for r, ring in enumerate(self.rings):
            ctl = ring.control
            self._profile[r] = ctl.mode == "profile"
            if r in self._parked and r not in self._released:
                if ctl.pause_requested():
                    self._bench(r)
                else:
                    ctl.set_paused(False)
                    self._released.add(r)
        if self._parked and self._released >= set(self._parked):
            self._resume()

    def _bench(self, r: int) -> None:
        """Answer the parked rank's requests once its queued GPU work has drained (each waits
        from when it was seen; the wait is its drain_ns), or after DRAIN_TIMEOUT_S."""
        ctl = self.rings[r].control
        mine = self._benches.setdefault(r, [])
        for req_id, req in ctl.pending():
            ctl.answer(req_id, BenchState.RUNNING, [])
            mine.append((req_id, req, self._v))
        drained = self._drained.get(r, np.inf)
        left = []
        for req_id, req, seen in mine:
            ready = min(max(seen, drained), seen + DRAIN_TIMEOUT_S)
            if ready > self._v:
                left.append((req_id, req, seen))
                continue
            livectl.answer_request(ctl, self.model, r, req_id, req, ready, self._rng,
                                   drain_ns=round((ready - seen) * 1e9))
        self._benches[r] = left

    def _stops(self, starts: np.ndarray, ends: np.ndarray,
               parked_at: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """Per rank, the index of the first call its host cannot enqueue and the first its GPU
        cannot complete. Only a pause stops anything: a parked host stops at its call, a GPU at
        the first call that needs a parked rank's missing call (transitively), and a host whose
        GPU cannot finish an iteration waits in that iteration's synchronisation."""
        if not parked_at:
            return ends.copy(), ends.copy()
        rank = self._rank
        done = self._state & Progress.DONE != 0
        gpu_stop = livectl.blocked_from(rank, self._rec, starts, ends, parked_at, done)
        host_stop = ends.copy()
        for r in np.flatnonzero(gpu_stop < ends).tolist():
            s, e = int(starts[r]), int(ends[r])
            it = self._iter[gpu_stop[r]]
            host_stop[r] = s + int(np.searchsorted(self._iter[s:e], it, side="right"))
        for r, i in parked_at.items():
            host_stop[r] = min(host_stop[r], i)
        return host_stop, gpu_stop

    def _park_new(self, starts: np.ndarray, ends: np.ndarray, v_ns: int, host_stop: np.ndarray,
                  parked_at: dict[int, int]) -> bool:
        """Ranks asked to pause park at the target call once their host reaches it."""
        rec = self._rec
        entered = self._state & Progress.ENTERED != 0
        parked = False
        for r, ring in enumerate(self.rings):
            ctl = ring.control
            if r in self._parked or not ctl.pause_requested():
                continue
            comm, seq = ctl.pause_target()
            s, e = int(starts[r]), int(ends[r])
            i = livectl.park_index(rec[s:e], comm, seq, entered[s:e])
            if i is None or s + i >= host_stop[r] or int(rec["enter_ns"][s + i]) > v_ns:
                continue
            self._parked[r] = int(rec["enter_ns"][s + i])
            parked_at[r] = s + i
            ctl.set_paused(True, tid=os.getpid())
            parked = True
        return parked

    def _parked_index(self, starts: np.ndarray, ends: np.ndarray) -> dict[int, int]:
        """Absolute index of the call each parked rank is parked at (still pending)."""
        enter = self._rec["enter_ns"]
        return {r: int(starts[r] + np.searchsorted(enter[starts[r]:ends[r]], np.uint64(ns)))
                for r, ns in self._parked.items()}

    def _drain_times(self, starts: np.ndarray, parked_at: dict[int, int], gpu_stop: np.ndarray,
                     state: np.ndarray) -> None:
        """When each parked rank's GPU has finished the work its host queued before parking:
        its calls enqueued before the parked one, and the kernels up to that call."""
        rec, done = self._rec, state & Progress.DONE != 0
        for r, i in parked_at.items():
            s = int(starts[r])
            left = np.flatnonzero(~done[s:i]) + s
            if np.any(left >= gpu_stop[r]):
                self._drained[r] = np.inf
                continue
            last = max([int(rec["gpu_start_ns"][i]), *rec["gpu_end_ns"][left].tolist()])
            self._drained[r] = (last - self.mono0_ns) / 1e9

    def _resume(self) -> None:
        """Everything the pause held back happens later by the pause's virtual length: calls not
        enqueued yet are enqueued later, GPU work that could not run runs later, calls a GPU
        was waiting in complete later."""
        since = (min(self._parked.values()) - self.mono0_ns) / 1e9
        d_ns = np.uint64(round(max(0.0, self._v - since) * 1e9))
        rank, rec, state = self._rank, self._rec, self._state
        starts, ends = self._segments()
        parked_at = self._parked_index(starts, ends)
        host_stop, gpu_stop = self._stops(starts, ends, parked_at)
        pos = np.arange(len(rec))
        v_ns = self.codec.ns(np.array([self._v]))[0]
        entered = state & Progress.ENTERED != 0
        blocked = (pos >= gpu_stop[rank]) & (state & Progress.DONE == 0)
        waiting = blocked & entered & (pos == gpu_stop[rank]) & (rec["gpu_start_ns"] <= v_ns)
        held = (pos >= host_stop[rank]) & ~entered
        for field, sel in (("gpu_start_ns", blocked & ~waiting), ("gpu_end_ns", blocked),
                           ("enter_ns", held), ("return_ns", held)):
            col = rec[field]
            col[sel & (col != NEVER_NS)] += d_ns
        # A GPU does not reach a call before its host enqueued it.
        rec["gpu_start_ns"] = np.maximum(rec["gpu_start_ns"], rec["enter_ns"])
        rec["gpu_end_ns"] = np.maximum(rec["gpu_end_ns"], rec["gpu_start_ns"])
        delay = int(d_ns) / 1e9
        self._ends = [e + delay if e > since else e for e in self._ends]
        self._starts = [t + delay if t > since else t for t in self._starts]
        self._model_t += delay
        self._parked.clear()
        self._released.clear()
        self._drained.clear()
        self._benches.clear()

    def close(self, *, remove: bool = False) -> None:
        for ring in self.rings:
            ring.close()
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)
