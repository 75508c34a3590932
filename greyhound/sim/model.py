"""The simulated cluster: topology, faults and mitigation state in, per-iteration timings out.

Ranks follow Megatron's default order ``rank = tp + TP * (dp + DP * pp)``, so a per-rank array
reshaped to (PP, DP, TP) is indexed ``[pp, dp, tp]``. Rank ``r`` runs on GPU ``gpu_of_rank[r]``
(the identity until a plan moves ranks) on node ``gpu // gpus_per_node``. Links: NVLink inside a
node, one network link per node pair (per-GPU rail bandwidth, divided by its congestion).

Each rank has a host and a GPU. The host returns from the previous iteration's synchronisation
when the iteration starts, then issues the whole iteration (kernels and NCCL calls) at its own
pace, ahead of the GPU, and blocks in the next synchronisation. A slow GPU stretches its kernels;
CPU contention stretches its node's host work, which shows on the GPU only once the host falls
behind it (see :class:`~greyhound.sim.scenario.JobSpec`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from greyhound.core.arrays import FloatArray, IntArray
from greyhound.core.plans import Plan
from greyhound.sim import faults as flt
from greyhound.sim import hang_cascade as hc
from greyhound.sim import timeline as tl
from greyhound.sim.events import CommTable, EventBlock, IterationTiming, Op
from greyhound.sim.mitigation import Layout, apply
from greyhound.sim.scenario import HangCall, JobSpec, Scenario
from greyhound.sim.schedule import pipeline_order, ring_allreduce_s, run_pipeline, tree_allreduce_s

# The calls a hang fault may take, by its scenario's ``call``; an inconsistent hang is always an
# all-reduce's (a mismatched op, count or type among peers).
CALL_OPS: dict[HangCall, tuple[Op, ...]] = {
    "any": tuple(Op), "collective": (Op.ALLREDUCE, Op.ALLGATHER), "p2p": (Op.SEND, Op.RECV)}


@dataclass(frozen=True, slots=True, eq=False)
class Derived:
    """Everything that changes only when a fault starts or ends or a plan is applied."""

    rel: FloatArray  # (PP, DP, TP) GPU compute multiplier of each rank
    host: FloatArray  # (PP, DP, TP) host work multiplier of each rank (its node's contention)
    comp: FloatArray  # (PP, DP, TP) GPU seconds of forward+backward per micro-batch
    tp_ar: FloatArray  # (PP, DP) one TP all-reduce
    xfer: FloatArray  # (PP-1, DP, TP) one activation between stage s and s+1
    dp_ar: FloatArray  # (PP, TP) the gradient all-reduce of each DP group
    dp_algorithm: tuple[str, ...]  # per stage, as NCCL's tuner would pick from nominal speeds


def derive(job: JobSpec, gpu_of_rank: IntArray, slow: flt.Slowness) -> Derived:
    pp, dp, tp = job.pp, job.dp, job.tp
    gpus = gpu_of_rank.reshape(pp, dp, tp)
    nodes = gpus // job.gpus_per_node
    rel = slow.gpu[gpus]
    link = _Links(job, slow)
    bw, lat = link.between(gpus, np.roll(gpus, -1, axis=2))
    tp_ar = ring_allreduce_s(tp, job.tp_bytes, bw.min(axis=2), float(lat.max(initial=0.0)))
    bw, lat = link.between(gpus[:-1], gpus[1:])
    xfer = lat + job.pp_activation_bytes / bw
    dp_ar, algos = _dp_allreduce(job, gpus, link)
    return Derived(rel, slow.cpu[nodes], job.microbatch_compute_s * rel, tp_ar, xfer, dp_ar, algos)


class _Links:
    def __init__(self, job: JobSpec, slow: flt.Slowness) -> None:
        self.job, self.slow = job, slow

    def between(
        self, a: IntArray, b: IntArray, *, nominal: bool = False
    ) -> tuple[FloatArray, FloatArray]:
        """Bandwidth (bytes/s) and latency (s) of the path between GPUs ``a`` and ``b``."""
        j = self.job
        na, nb = a // j.gpus_per_node, b // j.gpus_per_node
        same = na == nb
        bw = np.where(same, j.nvlink_gbps, j.link_gbps) * (1e9 / 8)
        if not nominal:
            lo, hi = np.minimum(na, nb), np.maximum(na, nb)
            for x, y, factor in self.slow.links:
                bw = np.where((lo == x) & (hi == y), bw / factor, bw)
        lat = np.where(same, j.nvlink_latency_us, j.link_latency_us) * 1e-6
        return bw, lat


def _dp_allreduce(job: JobSpec, gpus: IntArray, link: _Links) -> tuple[FloatArray, tuple[str, ...]]:
    """Ring or tree per stage; NCCL chooses from nominal speeds, congestion only slows it."""
    n, size = job.dp, job.dp_allreduce_bytes
    if n == 1:
        return np.zeros((job.pp, job.tp)), ("ring",) * job.pp
    ring_next = np.roll(gpus, -1, axis=1)
    parent = gpus[:, (np.arange(1, n) - 1) // 2, :]
    times: dict[str, FloatArray] = {}
    nominal: dict[str, FloatArray] = {}
    for name, (a, b) in {"ring": (gpus, ring_next), "tree": (gpus[:, 1:, :], parent)}.items():
        for real in (True, False):
            bw, lat = link.between(a, b, nominal=not real)
            bw_min, lat_max = bw.min(axis=1), float(lat.max())
            if name == "ring":
                t = ring_allreduce_s(n, size, bw_min, lat_max)
            else:
                t = tree_allreduce_s(n, size, bw_min, lat_max, job.tree_efficiency)
            (times if real else nominal)[name] = t
    if job.dp_algorithm != "auto":
        return times[job.dp_algorithm], (job.dp_algorithm,) * job.pp
    tree = nominal["tree"].max(axis=1) < nominal["ring"].max(axis=1)
    algos = tuple("tree" if x else "ring" for x in tree)
    return np.where(tree[:, None], times["tree"], times["ring"]), algos


class ClusterModel:
    """Pure simulation state: no I/O, no clocks; the caller advances virtual time."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.job = job = scenario.job
        self.layout = Layout.initial(job)
        self.comms = CommTable(job.tp, job.dp, job.pp)
        self._ranks: IntArray = np.arange(job.world, dtype=np.int64).reshape(job.pp, job.dp, job.tp)
        self._rng = np.random.default_rng(scenario.seed)
        self._index = 0
        self._now = 0.0
        self._hung = False
        self._struck: set[int] = set()
        self._key: tuple[object, ...] | None = None
        self._derived: Derived | None = None
        self._tp_seq = np.zeros(self.comms.size, dtype=np.int64)
        self._dp_seq = np.zeros(self.comms.size, dtype=np.int64)
        self._pp_seq = np.zeros(job.world, dtype=np.int64)

    @property
    def hung(self) -> bool:
        return self._hung

    def derived(self, t: float) -> Derived:
        faults, layout = self.scenario.faults, self.layout
        active = flt.active_set(faults, t, layout.cleared)
        key = (active, layout.version)
        if self._derived is None or key != self._key:
            slow = flt.slowness(self.job, faults, active)
            self._derived, self._key = derive(self.job, layout.gpu_of_rank, slow), key
        return self._derived

    def slowness(self, t: float) -> flt.Slowness:
        faults = self.scenario.faults
        return flt.slowness(self.job, faults, flt.active_set(faults, t, self.layout.cleared))

    def gemm_s(self, gpu: int, n: int, t: float) -> float:
        """One N x N x N FP32 GEMM on ``gpu`` at virtual time ``t`` (its slow factor applies)."""
        return 2.0 * n**3 / (self.job.gemm_tflops * 1e12) * float(self.slowness(t).gpu[gpu])

    def p2p_s(self, gpu_a: int, gpu_b: int, nbytes: int, t: float) -> float:
        """One transfer of ``nbytes`` from ``gpu_a`` to ``gpu_b`` (NVLink or the congested link)."""
        a, b = np.array([gpu_a]), np.array([gpu_b])
        bw, lat = _Links(self.job, self.slowness(t)).between(a, b)
        return float(lat[0] + nbytes / bw[0])

    def apply_plan(self, plan: Plan) -> float:
        s = self.scenario
        cost = apply(plan, self.layout, self.job, s.faults, s.costs, self._now)
        if self._hung and any(i in self.layout.cleared for i in self._struck):
            self._hung = False
        return cost

    def iteration(self, t_virtual_s: float, *, events: bool = True) -> IterationTiming:
        """Simulate the iteration starting at ``t_virtual_s``; ``events=False`` skips the records."""
        job, noise, t0 = self.job, self.scenario.noise, t_virtual_s
        self._now = t0
        index, self._index = self._index, self._index + 1
        if self._hung:
            empty = np.zeros(job.world)
            return IterationTiming(index, t0, np.inf, empty, empty.copy(), (), True, ())
        d = self.derived(t0)
        runs = self._pipelines(d)
        pp, dp, tp = job.pp, job.dp, job.tp
        last = np.empty((pp, dp))
        host_dp = np.empty((pp, dp, tp))  # when each host enqueues its DP all-reduce
        call_s = np.empty((pp, dp, tp))
        compute = np.zeros((pp, dp, tp))
        stages = np.arange(pp)
        for run in runs:
            m = run.order.m
            last_op = stages * 2 * m + 2 * m - 1
            last[:, run.ds] = run.end[last_op]
            host_dp[:, run.ds, :] = run.host.at(last_op, stages, run.host.calls.dp_at)
            call_s[:, run.ds, :] = run.host.call_s
            compute[:, run.ds, :] = run.offset.reshape(pp, 2 * m, len(run.ds), tp).sum(1)
        dp_arrive = np.maximum(last[:, :, None], host_dp)
        dp_exit = dp_arrive.max(axis=1) + d.dp_ar
        # The optimizer's kernels follow the DP all-reduce on the GPU and its launch on the host.
        host_done = host_dp + call_s * (dp > 1) + job.host_fraction * job.optimizer_s * d.host
        finish = np.maximum(dp_exit[:, None, :] + job.optimizer_s * d.rel, host_done)
        duration = float(finish.max())
        if noise.checkpoint_every and (index + 1) % noise.checkpoint_every == 0:
            duration += noise.checkpoint_s
        compute += job.optimizer_s * d.rel
        hang = flt.pending_hang(self.scenario.faults, t0, t0 + duration, self.layout.cleared)
        if hang is not None and hang in self._struck:
            hang = None
        blocks: tuple[EventBlock, ...] = ()
        if events or hang is not None:
            blocks = self._blocks(d, runs, dp_arrive, dp_exit, host_dp, call_s, t0)
        hung = False
        if hang is not None:
            delay = self._strike(hang, blocks)
            if delay is not None:
                duration += delay
                hung = self._hung = not np.isfinite(delay)
        self._advance(runs)
        comm = tl.busy_time(blocks, job.world) if events else np.zeros(0)
        return IterationTiming(
            index, t0, duration, compute.ravel(), comm, blocks if events else (), hung,
            d.dp_algorithm,
        )

    def _pipelines(self, d: Derived) -> list[tl.BucketRun]:
        job, noise, rng = self.job, self.scenario.noise, self._rng
        counts = np.asarray(self.layout.counts)
        gc = None
        if noise.gc_prob > 0 and rng.random() < noise.gc_prob:
            gc = int(rng.integers(job.world)), float(rng.random())
        xtab = np.concatenate([d.xfer.max(axis=2)] * 2 + [np.zeros((1, job.dp))])
        runs = []
        for m in np.unique(counts):
            order = pipeline_order(job.pp, int(m))
            ds = np.flatnonzero(counts == m)
            frac = np.where(order.forward, job.forward_fraction, 1.0 - job.forward_fraction)
            scale = np.broadcast_to(frac[:, None], (order.n_ops, len(ds)))
            if noise.jitter_cv > 0:
                scale = scale * np.exp(rng.normal(0.0, noise.jitter_cv, scale.shape))
            offset = d.comp[order.stage][:, ds, :] * scale[:, :, None]
            if gc is not None:
                s, dd, t = np.unravel_index(gc[0], (job.pp, job.dp, job.tp))
                col = np.flatnonzero(ds == dd)
                if len(col):
                    op = int(s) * 2 * int(m) + int(gc[1] * 2 * m)
                    offset[op, col[0], t] += noise.gc_pause_s
            # Each host issues an operation in host_fraction of its nominal GPU time (times
            # its node's contention); the GPU cannot finish it before (run_pipeline's floor),
            # which matters only where a stage's host falls behind its GPU's own work.
            hosts = d.host[:, ds, :]
            work = job.host_fraction * job.microbatch_compute_s * frac
            host = tl.HostLaunch.of(order, work, hosts, job.launch_us * 1e-6 * hosts,
                                    job.tp > 1)
            tp_ar = d.tp_ar[order.stage][:, ds]
            dur = offset.max(axis=2) + tp_ar
            floor = host.last_ready() + tp_ar
            own = np.cumsum(dur.reshape(job.pp, 2 * int(m), -1), axis=1).reshape(dur.shape)
            start, end = run_pipeline(order, dur, xtab[:, ds],
                                      floor if np.any(floor > own) else None)
            runs.append(tl.BucketRun(order, ds, start, end, offset, host))
        return runs

    def _blocks(
        self, d: Derived, runs: list[tl.BucketRun], dp_arrive: FloatArray, dp_exit: FloatArray,
        host_dp: FloatArray, call_s: FloatArray, t0: float,
    ) -> tuple[EventBlock, ...]:
        job, ranks, comms = self.job, self._ranks, self.comms
        gpus = self.layout.gpu_of_rank
        out: list[EventBlock] = []
        for run in runs:
            if job.tp > 1:
                out.append(tl.tp_block(run, ranks, gpus, comms, self._tp_seq, int(job.tp_bytes)))
            if job.pp > 1:
                out += tl.p2p_blocks(
                    run, ranks, gpus, comms, self._pp_seq, d.xfer, int(job.pp_activation_bytes)
                )
        if job.dp > 1:
            size = int(job.dp_allreduce_bytes)
            out.append(tl.dp_block(dp_arrive, dp_exit, host_dp, call_s, ranks, gpus, comms,
                                   self._dp_seq, size))
        return tuple(tl.shifted(b, t0) for b in out)

    def _strike(self, hang: int, blocks: tuple[EventBlock, ...]) -> float | None:
        """Hang the victim's first call after the fault starts, spread the hang to every rank
        that then needs a stuck one (see :mod:`greyhound.sim.hang_cascade`); return the delay.

        A rank that never enters a call, or enters a different one, is the host's doing: the
        fault takes the first call its host enqueues from the fault's start on, and the host
        enqueues nothing from there until the fault ends. A call that never completes is the
        GPU's: the first call its GPU reaches from the fault's start on. Either way the other
        hosts run on to their synchronisation; only GPUs wait."""
        f = self.scenario.faults[hang]
        assert f.rank is not None
        victim = int(self.layout.rank_of_gpu()[f.rank])
        by_host = f.kind in ("hang_not_entered", "hang_inconsistent")
        best: tuple[float, int, int] | None = None
        # A mismatch is a collective's (another op, count or type than its peers); a send and a
        # receive posted together would make "which of the two" ambiguous in the counters.
        wanted = (Op.ALLREDUCE,) if f.kind == "hang_inconsistent" else CALL_OPS[f.call]
        for i, b in enumerate(blocks):
            when = b.host_enter if by_host else b.gpu_start
            idx = np.flatnonzero((b.rank == victim) & (when >= f.start_s) & np.isin(b.op, wanted))
            if len(idx):
                j = int(idx[np.argmin(when[idx])])
                if best is None or when[j] < best[0]:
                    best = (float(when[j]), i, j)
        if best is None:
            return None
        self._struck.add(hang)
        _, bi, j = best
        offsets = np.cumsum([0] + [len(b) for b in blocks])
        at = int(offsets[bi]) + j
        rank = np.concatenate([b.rank for b in blocks])
        arrive = np.concatenate([b.gpu_start for b in blocks])
        instance = hc.call_instances(blocks)
        never_returns = np.zeros(len(rank), bool)
        absent = np.zeros(len(rank), bool)
        if f.kind == "hang_not_entered":
            absent[at] = True
        elif f.kind == "hang_inconsistent":
            never_returns[instance == instance[at]] = True
        else:
            never_returns[at] = True
        sp = hc.spread(rank, instance, arrive, self.job.world,
                       never_returns=never_returns, absent=absent)
        delay = f.end_s - float(blocks[bi].gpu_start[j])
        host_delay = f.end_s - float(blocks[bi].host_enter[j])
        entered_at = float(blocks[bi].host_enter[j])
        for i, b in enumerate(blocks):
            part = slice(int(offsets[i]), int(offsets[i + 1]))
            later, stuck = ~sp.reached[part], sp.stuck[part]
            b.gpu_start[later] += delay
            b.gpu_end[later | stuck] += delay
            if f.kind == "hang_not_entered":
                held = (b.rank == victim) & (b.host_enter >= entered_at)
                b.host_enter[held] += host_delay
                b.host_return[held] += host_delay
                np.maximum(b.gpu_start, b.host_enter, out=b.gpu_start, where=held)
                np.maximum(b.gpu_end, b.gpu_start, out=b.gpu_end, where=held)
        if f.kind == "hang_inconsistent":
            blocks[bi].op[j] = Op.ALLGATHER
        return delay

    def _advance(self, runs: list[tl.BucketRun]) -> None:
        job, comms = self.job, self.comms
        for run in runs:
            m = run.order.m
            tp_comm = np.arange(job.pp)[:, None] * job.dp + run.ds[None, :]
            self._tp_seq[tp_comm] += 2 * m
            per_stage = tl.p2p_plan(job.pp, m).per_stage
            self._pp_seq[self._ranks[:, run.ds, :]] += per_stage[:, None, None]
        self._dp_seq[comms.dp_base : comms.pp_base] += 1
