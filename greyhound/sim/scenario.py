"""Scenario files: a simulated job, its noise and the faults injected into it in virtual time.

Validation is strict (unknown keys are errors) because a typo in a fault would otherwise silently
turn an experiment into a healthy run. Every error names the offending field, e.g.
``faults[2].rank: 300 is out of range [0, 256)``.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import yaml

from greyhound.core.hang_diagnosis import HangKind

# A hang is injected under the name CCL-D's diagnosis gives its cause, so runs score by kind.
FaultKind = Literal["gpu_slow", "cpu_contention", "link_congestion", HangKind]
FAULT_KINDS: tuple[FaultKind, ...] = get_args(FaultKind)
HANG_KINDS: frozenset[HangKind] = frozenset(get_args(HangKind))
# Which of its calls a hang takes, the first of them from its start on: any (whatever the
# victim's host or GPU reaches first), a collective, or a pipeline send or receive. A hang in a
# pipeline call can only be narrowed to the pair (both ends pending on each other), so a
# scenario that wants one named rank says "collective" rather than depend on where in the
# iteration its start falls.
HangCall = Literal["any", "collective", "p2p"]
HANG_CALLS: tuple[HangCall, ...] = get_args(HangCall)
DpAlgorithm = Literal["auto", "ring", "tree"]


class ScenarioError(ValueError):
    """A scenario that cannot be simulated; ``field`` is the dotted path of the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True, slots=True)
class JobSpec:
    """One Megatron-style job. Sizes are per GPU; bandwidths in Gbit/s as vendors quote them.

    ``link_gbps`` is the bandwidth one GPU gets to a GPU of another node (rail-optimised
    clusters give every GPU its own NIC, so the TP-rank rings of one DP all-reduce do not share
    it); a congested node pair divides it.

    The host runs ahead of the GPU (NCCL and kernel launches are asynchronous) and synchronises
    once per iteration. ``host_fraction`` is the host's work to issue one micro-batch (kernel
    launches, data handling) as a share of that micro-batch's healthy GPU time, and
    ``launch_us`` the host time of one NCCL call. CPU contention multiplies both: it slows the
    job only once the host needs longer than the GPU, which then waits for launches (at the
    default 0.1, contention beyond 10x).
    """

    tp: int
    dp: int
    pp: int
    gpus_per_node: int
    microbatches: int
    microbatch_compute_s: float
    dp_allreduce_bytes: float
    pp_activation_bytes: float
    link_gbps: float
    nvlink_gbps: float
    tp_allreduce_bytes: float | None = None
    link_latency_us: float = 5.0
    nvlink_latency_us: float = 1.0
    forward_fraction: float = 1.0 / 3.0
    host_fraction: float = 0.1
    launch_us: float = 5.0
    optimizer_s: float = 0.01
    dp_algorithm: DpAlgorithm = "auto"
    tree_efficiency: float = 0.85
    gemm_tflops: float = 50.0  # FP32 GEMM rate of a healthy GPU (the validator's benchmark)

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def nodes(self) -> int:
        return -(-self.world // self.gpus_per_node)

    @property
    def tp_bytes(self) -> float:
        """One aggregated TP all-reduce per pass: about one activation's worth by default."""
        return self.pp_activation_bytes if self.tp_allreduce_bytes is None else self.tp_allreduce_bytes


@dataclass(frozen=True, slots=True)
class NoiseSpec:
    """Iteration-time noise real jobs show; all off gives the closed forms exactly."""

    jitter_cv: float = 0.01
    gc_prob: float = 0.02
    gc_pause_s: float = 0.05
    checkpoint_every: int = 0
    checkpoint_s: float = 30.0


@dataclass(frozen=True, slots=True)
class CostSpec:
    """Virtual-time cost of each mitigation action (paper: S2 low, S3 ~1 min, S4 tens of minutes)."""

    microbatch_s: float = 0.5
    reconfigure_s: float = 60.0
    restart_s: float = 1800.0


@dataclass(frozen=True, slots=True)
class MitigationSpec:
    """How the simulated job treats the planner's plans in a live run: ``follow_plans`` makes it
    fetch the current plan, apply it at an iteration boundary (paying ``costs``) and report it.
    A scenario without a ``mitigation`` section never follows plans, so the incidents of the
    scenarios written before plans existed stay what they were."""

    follow_plans: bool = True
    poll_s: float = 0.25  # wall seconds between two looks at the job's current plan


@dataclass(frozen=True, slots=True)
class FaultSpec:
    kind: FaultKind
    start_s: float
    duration_s: float | None = None
    factor: float = 1.0
    rank: int | None = None
    node: int | None = None
    nodes: tuple[int, int] | None = None
    call: HangCall = "any"  # a hang's: which of the victim's calls it takes

    @property
    def end_s(self) -> float:
        return math.inf if self.duration_s is None else self.start_s + self.duration_s

    def active(self, t: float) -> bool:
        return self.start_s <= t < self.end_s


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    job: JobSpec
    duration_s: float
    seed: int = 0
    faults: tuple[FaultSpec, ...] = ()
    noise: NoiseSpec = field(default_factory=NoiseSpec)
    costs: CostSpec = field(default_factory=CostSpec)
    mitigation: MitigationSpec | None = None

    @property
    def follows_plans(self) -> bool:
        return self.mitigation is not None and self.mitigation.follow_plans


class _Loader(yaml.SafeLoader):
    """YAML 1.2 floats: PyYAML (YAML 1.1) would read the issue's ``2.0e9`` as a string."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)?(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_scenario(path: Path) -> Scenario:
    try:
        data = yaml.load(Path(path).read_text(), Loader=_Loader)
    except yaml.YAMLError as exc:
        raise ScenarioError("<file>", f"not valid YAML: {exc}") from exc
    if not isinstance(data, Mapping):
        raise ScenarioError("<root>", "a scenario must be a mapping")
    if "name" not in data:
        data = {**data, "name": Path(path).stem}
    return parse_scenario(data)


def parse_scenario(data: Mapping[str, Any]) -> Scenario:
    _only(data, "", {"name", "job", "duration_s", "seed", "faults", "noise", "costs",
                     "mitigation"})
    job = _job(_mapping(data, "job", required=True))
    faults_raw = data.get("faults") or []
    if not isinstance(faults_raw, list):
        raise ScenarioError("faults", "must be a list")
    faults = tuple(_fault(f, f"faults[{i}]", job) for i, f in enumerate(faults_raw))
    _check_hangs(faults)
    name = data.get("name", "scenario")
    if not isinstance(name, str):
        raise ScenarioError("name", "must be a string")
    return Scenario(
        name=name,
        job=job,
        duration_s=_num(data, "duration_s", "", positive=True),
        seed=_int(data, "seed", "", default=0, minimum=0),
        faults=faults,
        noise=_noise(_mapping(data, "noise")),
        costs=_costs(_mapping(data, "costs")),
        mitigation=_mitigation(data),
    )


def _job(d: Mapping[str, Any]) -> JobSpec:
    p = "job."
    _only(d, "job", set(JobSpec.__slots__))
    algo = d.get("dp_algorithm", "auto")
    if algo not in ("auto", "ring", "tree"):
        raise ScenarioError(p + "dp_algorithm", f"{algo!r} is not one of auto, ring, tree")
    tp_bytes = d.get("tp_allreduce_bytes")
    job = JobSpec(
        tp=_int(d, "tp", p, minimum=1),
        dp=_int(d, "dp", p, minimum=1),
        pp=_int(d, "pp", p, minimum=1),
        gpus_per_node=_int(d, "gpus_per_node", p, minimum=1),
        microbatches=_int(d, "microbatches", p, minimum=1),
        microbatch_compute_s=_num(d, "microbatch_compute_s", p, positive=True),
        dp_allreduce_bytes=_num(d, "dp_allreduce_bytes", p),
        pp_activation_bytes=_num(d, "pp_activation_bytes", p),
        link_gbps=_num(d, "link_gbps", p, positive=True),
        nvlink_gbps=_num(d, "nvlink_gbps", p, positive=True),
        tp_allreduce_bytes=None if tp_bytes is None else _num(d, "tp_allreduce_bytes", p),
        link_latency_us=_num(d, "link_latency_us", p, default=5.0),
        nvlink_latency_us=_num(d, "nvlink_latency_us", p, default=1.0),
        forward_fraction=_num(d, "forward_fraction", p, default=1.0 / 3.0, positive=True),
        host_fraction=_num(d, "host_fraction", p, default=0.1),
        launch_us=_num(d, "launch_us", p, default=5.0),
        optimizer_s=_num(d, "optimizer_s", p, default=0.01),
        dp_algorithm=algo,
        tree_efficiency=_num(d, "tree_efficiency", p, default=0.85, positive=True),
        gemm_tflops=_num(d, "gemm_tflops", p, default=50.0, positive=True),
    )
    if job.microbatches < job.dp:
        raise ScenarioError(p + "microbatches", f"{job.microbatches} < dp ({job.dp}): a group idles")
    for name in ("forward_fraction", "host_fraction", "tree_efficiency"):
        if getattr(job, name) > 1.0:
            raise ScenarioError(p + name, "must be at most 1")
    return job


def _fault(raw: Any, p: str, job: JobSpec) -> FaultSpec:
    if not isinstance(raw, Mapping):
        raise ScenarioError(p, "a fault must be a mapping")
    kind = raw.get("kind")
    if kind not in FAULT_KINDS:
        raise ScenarioError(p + ".kind", f"{kind!r} is not one of {', '.join(FAULT_KINDS)}")
    target = {"cpu_contention": "node", "link_congestion": "nodes"}.get(kind, "rank")
    keys = {"kind", "start_s", "duration_s", target}
    if kind in ("gpu_slow", "cpu_contention", "link_congestion"):
        keys.add("factor")
    if kind in ("hang_hardware", "hang_not_entered"):  # an inconsistent one is a collective's
        keys.add("call")
    _only(raw, p, keys)
    q = p + "."
    start = _num(raw, "start_s", q, default=0.0)
    duration = None if raw.get("duration_s") is None else _num(raw, "duration_s", q, positive=True)
    factor = _num(raw, "factor", q, positive=True) if "factor" in keys else 1.0
    if target == "rank":
        call = raw.get("call", "any")
        if call not in HANG_CALLS:
            raise ScenarioError(q + "call", f"{call!r} is not one of {', '.join(HANG_CALLS)}")
        return FaultSpec(kind, start, duration, factor, rank=_index(raw, "rank", q, job.world),
                         call=call)
    if target == "node":
        return FaultSpec(kind, start, duration, factor, node=_index(raw, "node", q, job.nodes))
    pair = raw.get("nodes")
    if not isinstance(pair, list | tuple) or len(pair) != 2:
        raise ScenarioError(q + "nodes", "must be a list of two node indices")
    a = _index({"nodes[0]": pair[0]}, "nodes[0]", q, job.nodes)
    b = _index({"nodes[1]": pair[1]}, "nodes[1]", q, job.nodes)
    if a == b:
        raise ScenarioError(q + "nodes", "a link joins two different nodes")
    return FaultSpec(kind, start, duration, factor, nodes=(min(a, b), max(a, b)))


def _check_hangs(faults: tuple[FaultSpec, ...]) -> None:
    """Two hangs at once have no single root cause to diagnose, so scenarios may not ask for it."""
    hangs = sorted(
        ((f.start_s, f.end_s, i) for i, f in enumerate(faults) if f.kind in HANG_KINDS),
    )
    for (_, end_a, a), (start_b, _, b) in itertools.pairwise(hangs):
        if start_b < end_a:
            raise ScenarioError(f"faults[{b}].start_s", f"hang overlaps the hang of faults[{a}]")


def _noise(d: Mapping[str, Any]) -> NoiseSpec:
    _only(d, "noise", set(NoiseSpec.__slots__))
    p, n = "noise.", NoiseSpec()
    prob = _num(d, "gc_prob", p, default=n.gc_prob)
    if prob > 1.0:
        raise ScenarioError(p + "gc_prob", "is a probability, at most 1")
    return NoiseSpec(
        jitter_cv=_num(d, "jitter_cv", p, default=n.jitter_cv),
        gc_prob=prob,
        gc_pause_s=_num(d, "gc_pause_s", p, default=n.gc_pause_s),
        checkpoint_every=_int(d, "checkpoint_every", p, default=0, minimum=0),
        checkpoint_s=_num(d, "checkpoint_s", p, default=n.checkpoint_s),
    )


def _costs(d: Mapping[str, Any]) -> CostSpec:
    _only(d, "costs", set(CostSpec.__slots__))
    c = CostSpec()
    return CostSpec(**{k: _num(d, k, "costs.", default=getattr(c, k)) for k in CostSpec.__slots__})


def _mitigation(data: Mapping[str, Any]) -> MitigationSpec | None:
    if "mitigation" not in data:
        return None
    d = _mapping(data, "mitigation")
    _only(d, "mitigation", set(MitigationSpec.__slots__))
    follow = d.get("follow_plans", True)
    if not isinstance(follow, bool):
        raise ScenarioError("mitigation.follow_plans", f"must be true or false, got {follow!r}")
    return MitigationSpec(follow, _num(d, "poll_s", "mitigation.", default=0.25, positive=True))


def _only(d: Mapping[str, Any], p: str, allowed: set[str]) -> None:
    for key in d:
        if key not in allowed:
            where = f"{p}.{key}" if p else str(key)
            raise ScenarioError(where, f"unknown field (expected one of {', '.join(sorted(allowed))})")


def _mapping(d: Mapping[str, Any], key: str, *, required: bool = False) -> Mapping[str, Any]:
    if key not in d or d[key] is None:
        if required:
            raise ScenarioError(key, "is required")
        return {}
    value = d[key]
    if not isinstance(value, Mapping):
        raise ScenarioError(key, "must be a mapping")
    return value


def _num(
    d: Mapping[str, Any], key: str, p: str, *, default: float | None = None, positive: bool = False
) -> float:
    if key not in d:
        if default is None:
            raise ScenarioError(p + key, "is required")
        return default
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ScenarioError(p + key, f"must be a finite number, got {v!r}")
    if v < 0 or (positive and v == 0):
        raise ScenarioError(p + key, f"must be {'positive' if positive else 'non-negative'}")
    return float(v)


def _int(
    d: Mapping[str, Any], key: str, p: str, *, default: int | None = None, minimum: int = 0
) -> int:
    if key not in d:
        if default is None:
            raise ScenarioError(p + key, "is required")
        return default
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ScenarioError(p + key, f"must be an integer, got {v!r}")
    if v < minimum:
        raise ScenarioError(p + key, f"must be at least {minimum}")
    return v


def _index(d: Mapping[str, Any], key: str, p: str, size: int) -> int:
    v = _int(d, key, p)
    if v >= size:
        raise ScenarioError(p + key, f"{v} is out of range [0, {size})")
    return v
