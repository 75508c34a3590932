"""``greyhound demo [--fault slow|link|hang|grouped|bench-peer-dies]``: one fault played through
every real layer.

Real parts all the way: the native hook preloaded into the test workload's rank processes over
the asynchronous fake NCCL/CUDA, the node agent draining their rings, NATS JetStream, the
tracker, the analyzer, the validator, Postgres and the REST API, from which the demo reads what
the system found. The faults are in stack/demo_faults.py.

The last line is ``RESULT {json}`` (kind, ranks, links, detected_s, localized_s,
host_ms_in_nccl_p50/p99, job_iterations_after, job_alive, ...), for scripts and the tests; the exit
status is 0 only when the incident named the injected fault (and, for grouped and
bench-peer-dies, the job trained on after the validation). Host time inside NCCL is shown next
to the GPU's time in the collectives: NCCL calls return once their work is enqueued, so the
first says nothing about the fault, and the incident is found from the GPU timeline anyway.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

import httpx
import numpy as np

from greyhound import hookabi as H
from greyhound.fakejob import FakeJob, FakeJobSpec, native_build_dir
from services.api.settings import ApiSettings
from services.common.settings import Settings
from services.tracker.settings import TrackerSettings
from services.validator.settings import for_cpu_fake
from stack.demo_faults import HANG_AHEAD, DemoFault, FaultKind, make_fault
from stack.demo_node import KillOnTransfer, SecondNode, control_totals
from stack.nccl_host_time import host_ns_in_nccl
from stack.up import Stack, wait_api

DEMO_HANG_FLOOR_S = 5.0  # the tracker's default (60 s) would make the hang demo last minutes
START_TIMEOUT_S = 90.0  # the job reaching the injection iteration (a loaded machine is slow)
RESUME_WAIT_S = 45.0  # the job's ranks running again after a validation (a dead agent's: its lease)
AFTER_S = 10.0  # how long the job is watched after the validation ended ...
AFTER_ITERS = 20  # ... at most: enough iterations to call it training


@dataclass
class DemoResult:
    """What the RESULT line carries. Times are seconds from the fault's start: the fault file
    written (slow, link), or the job's last completed iteration before the hung one (hang)."""

    fault: FaultKind
    injected: str
    job: str
    ok: bool = False
    kind: str | None = None
    ranks: list[int] = field(default_factory=list)
    links: list[list[int]] = field(default_factory=list)  # rank pairs the validator confirmed
    detected_s: float | None = None
    localized_s: float | None = None  # first timeline entry that named the injected culprit
    validated: str | None = None  # the validator's verdict, when it ran
    host_ms_in_nccl_p50: float | None = None
    host_ms_in_nccl_p99: float | None = None
    host_calls: int = 0
    gpu_ms_in_collectives_p50: float | None = None  # iterations completed since the fault
    hang_floor_s: float | None = None
    incident_id: str | None = None
    validation_outcome: str | None = None  # why the validation could not be carried out
    job_iterations_after: int | None = None  # every rank's, after the fault / validation ended
    job_alive: bool | None = None  # no rank process died (the watchdog model, a crash)
    bench_comms_aborted: int = 0  # benchmark communicators the hooks aborted (a failed transfer)
    pauses_shortened: int = 0  # pauses the hooks cut at a quarter of the job's timeout


def _at_s(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _incidents(base: str, job: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{base}/v1/incidents", params={"job_id": job}, timeout=10.0)
    r.raise_for_status()
    rows: list[dict[str, Any]] = r.json()
    return rows


def _culprit_text(c: dict[str, Any]) -> str:
    if c.get("link_ranks"):
        return "link(s) " + ", ".join(f"{a}-{b}" for a, b in c["link_ranks"])
    if c.get("compute_ranks"):
        return f"GPU rank(s) {c['compute_ranks']}"
    if c.get("op") is not None:
        return f"rank(s) {c.get('ranks')} at {c['op']} #{c.get('seq')}"
    if c.get("comm_ids"):
        return f"communicator(s) {c['comm_ids']}, ranks {c.get('ranks')}"
    return f"ranks {c.get('ranks')}"


def _entry_culprit(entry: dict[str, Any]) -> dict[str, Any]:
    """The culprit a timeline entry names: a localisation carries it (a hang's is the entry
    itself); a validation names GPUs and rank pairs."""
    d = entry.get("detail") or {}
    if entry["stage"] == "validated":
        return {"compute_ranks": d.get("gpus") or [], "ranks": d.get("gpus") or [],
                "link_ranks": d.get("links") or []}
    if entry["stage"] == "localized":
        return dict(d.get("culprit", d))
    return {}


def _describe(incident: dict[str, Any], entry: dict[str, Any]) -> str:
    d, stage = entry.get("detail") or {}, entry["stage"]
    if stage == "detected" and incident["kind"].startswith("hang"):
        return f"opened: {incident['summary']}"
    if stage == "detected":
        what = "opened" if "further" not in d else "noted"
        return (f"{what}: the tracker saw the iteration go from {1e3 * d.get('before_s', 0):.0f} ms "
                f"to {1e3 * d.get('after_s', 0):.0f} ms")
    if stage == "localized":
        kind = d.get("kind", incident["kind"])
        how = "from the counters (CCL-D)" if kind.startswith("hang") else "from the GPU timeline"
        return f"localized {how}: {kind}, {_culprit_text(_entry_culprit(entry))}"
    if stage == "validated":
        parts = [f"validated after pausing the job {d.get('pause_s', 0):.2f} s: {d.get('verdict')}"]
        if d.get("gemm_s"):
            parts.append(f"GEMM slowest/median {d.get('gemm_max_ratio', 0):.2f}x")
        if d.get("p2p_s"):
            parts.append(f"{len(d['p2p_s'])} links P2P-tested, slowest {d.get('p2p_max_ratio', 0):.2f}x")
        gpus, links = d.get("gpus") or [], d.get("links") or []
        if gpus or links:
            parts.append(_culprit_text({"compute_ranks": gpus, "link_ranks": links}))
        return "; ".join(parts)
    if stage == "resolved":
        return "resolved: the job recovered"
    return str(stage)


def _settled(fault: DemoFault, incident: dict[str, Any]) -> bool:
    """Named, and nothing more to wait for: a hang is named at once; a slowdown once the validator
    ran (or recorded why it could not)."""
    if not (fault.kind_ok(incident["kind"]) and fault.names_culprit(incident["culprit"] or {})):
        return False
    stages = {e["stage"] for e in incident.get("timeline") or []}
    return fault.kind == "hang" or "validated" in stages or "outcome" in (
        (incident.get("evidence") or {}).get("validation") or {})


class _Watch:
    """Prints each incident's timeline entries once, as they appear, timed from the fault."""

    def __init__(self, out: TextIO, t0_wall: float) -> None:
        self.out = out
        self.t0 = t0_wall
        self.seen: set[tuple[str, int]] = set()

    def show(self, rows: list[dict[str, Any]]) -> None:
        for inc in sorted(rows, key=lambda r: r["opened_at"]):
            for i, entry in enumerate(inc.get("timeline") or []):
                if (inc["id"], i) in self.seen:
                    continue
                self.seen.add((inc["id"], i))
                tag = f" [{inc['id'][:6]}]" if len(rows) > 1 else ""
                print(f"        {_at_s(entry['at']) - self.t0:+6.1f} s{tag}  "
                      f"{_describe(inc, entry)}", file=self.out, flush=True)


def _inject(fj: FakeJob, fault: DemoFault, at: int, out: TextIO) -> tuple[str, float]:
    """Write the fault line at iteration ``at``; (the line, the fault's start as a wall time)."""
    fj.wait_iteration(fault.rank, at, timeout=START_TIMEOUT_S)
    if fault.kind != "hang":
        line = fault.line()
        fj.faults.set(line)
        t0 = time.time()
        print(f"        iteration {at}: wrote `{line}` into the fake's fault file", file=out,
              flush=True)
        return line, t0
    seq = fj.iterations(fault.rank)[-1].it + HANG_AHEAD
    line = fault.line(seq)
    fj.faults.set(line)
    print(f"        iteration {at}: wrote `{line}`: the all-reduce of iteration {seq} will "
          f"hang on rank {fault.rank}'s GPU", file=out, flush=True)
    # The hang starts when the job stops progressing: its last iteration before the hung one.
    deadline = time.monotonic() + START_TIMEOUT_S
    for r in range(fault.job["world_size"]):
        fj.wait_iteration(r, seq - 1, timeout=max(1.0, deadline - time.monotonic()))
    last_ns = max(x.end_ns for r in range(fault.job["world_size"])
                  for x in fj.iterations(r) if x.it == seq - 1)
    return line, time.time() - (time.monotonic_ns() - last_ns) / 1e9


def _wait_served(base: str, fj: FakeJob, agent_of: dict[int, str]) -> None:
    """Until every rank of the job is registered by the agent that serves it (``agent_of``:
    ranks of a second node). A fault injected before an agent watches its ranks is profiled
    without them: on a loaded machine the second node's agent can take seconds to start, and the
    first localisation's window then never fills (half the ranks in monitor mode)."""
    job, n = fj.spec.job_id, fj.spec.world_size
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        r = httpx.get(f"{base}/v1/jobs/{job}", timeout=10.0)
        if r.status_code != 404:
            r.raise_for_status()
            served = {x["rank"]: x["agent_id"] for x in r.json()["ranks"]}
            if len(served) == n and all(served.get(k) == a for k, a in agent_of.items()):
                return
        if time.monotonic() > deadline or not fj.running():
            raise TimeoutError(f"the agents did not register every rank of job {job} within "
                               f"{START_TIMEOUT_S:g} s")
        time.sleep(0.2)


def _gpu_ms_p50(fj: FakeJob, ranks: int, since_wall: float) -> float | None:
    """Median device time from a rank's GPU reaching its collectives to their end (the
    transfers plus the wait for late peers), over the iterations begun since the fault."""
    since_ns = time.monotonic_ns() - int((time.time() - since_wall) * 1e9)
    ms = [x.gpu_comm_ms for r in range(ranks) for x in fj.iterations(r)
          if x.start_ns >= since_ns and x.gpu_arrive_ns and x.gpu_done_ns]
    return round(float(np.median(ms)), 3) if ms else None


def play(stack: Stack, fault: DemoFault, *, at: int = 100, timeout_s: float = 60.0,
         hang_floor_s: float | None = None, out: TextIO | None = None) -> DemoResult:
    """Run the demo's job on a running stack, inject the fault, and wait (at most
    ``timeout_s`` after the fault began) for an incident that names it; then watch the job
    train on. Prints to ``out`` (default: the current sys.stdout)."""
    out = out or sys.stdout
    base = f"http://127.0.0.1:{stack.port}"
    shm = Path(stack.settings.shm_dir)
    job = f"demo-{fault.kind}-{uuid.uuid4().hex[:6]}"
    spec = FakeJobSpec(job_id=job, iters=at + HANG_AHEAD + int(timeout_s * 1e3 / 20.0) + 600,
                       compute_busy=0.1, **fault.job)
    ranks = spec.world_size
    print(f"  [3/4] job {job}: {ranks} ranks of the test workload over the asynchronous fake "
          f"NCCL/CUDA, the hook preloaded; per iteration {spec.compute_ms:g} ms of GPU compute, "
          f"then a {spec.bytes >> 20} MB all-reduce", file=out, flush=True)
    print(f"        the fault: {fault.injects()}", file=out)
    if fault.kind == "hang" and hang_floor_s is not None:
        print(f"        the tracker calls a collective hung once it has been pending on the GPU "
              f"longer than max({hang_floor_s:g} s, 20 x the iteration)", file=out)
    print(f"        expected: {fault.expects()}", file=out, flush=True)
    work = Path(tempfile.mkdtemp(prefix="gh-demo-"))
    try:
        with contextlib.ExitStack() as held:
            node = held.enter_context(SecondNode(stack, f"node-b-{job.rsplit('-', 1)[-1]}",
                                                 work / "shm-node-b")) if fault.second_node else None
            dirs = {r: node.shm_dir for r in fault.second_node} if node is not None else {}
            fj = held.enter_context(FakeJob(
                spec, workdir=work, hook=native_build_dir() / "libgreyhound_hook.so",
                shm_dir=shm, shm_dir_of_rank=dirs))
            stack.lifeline.watch_group(fj.procs[0].pid)  # its ranks' group ends with the demo
            readers = _rings(fj, shm, dirs)
            _wait_served(base, fj, {r: node.agent_id for r in dirs} if node else {})
            line, t0 = _inject(fj, fault, at, out)
            res = DemoResult(fault.kind, line, job, hang_floor_s=hang_floor_s)
            if node is not None:
                first = [r for r in range(ranks) if r not in fault.second_node]
                killer = KillOnTransfer([H.ring_path(shm, job, r) for r in first], node)
                killer.start()
                held.callback(killer.stop)
                print(f"        the second node's agent ({node.agent_id}, ranks "
                      f"{list(fault.second_node)}) is killed once a transfer is submitted to "
                      f"ranks {first}", file=out, flush=True)
            print(f"        waiting up to {timeout_s:g} s for the tracker, analyzer and validator "
                  f"(timeline from the fault's start):", file=out, flush=True)
            incident = _wait(stack, base, job, fault, t0, timeout_s, out)
            if node is not None and node.killed_at is not None:
                print(f"        {_at_s_mono(node.killed_at) - t0:+6.1f} s  the second node's "
                      f"agent was killed (SIGKILL) mid-benchmark", file=out, flush=True)
            res.job_iterations_after, res.job_alive = _job_after(fj, readers, fault, out)
            totals = control_totals(readers)
            res.bench_comms_aborted = totals["bench_comms_aborted"]
            res.pauses_shortened = totals["pauses_shortened"]
            host = host_ns_in_nccl(shm, job)
            if host.size:
                res.host_ms_in_nccl_p50 = round(float(np.percentile(host, 50)) / 1e6, 4)
                res.host_ms_in_nccl_p99 = round(float(np.percentile(host, 99)) / 1e6, 4)
            res.host_calls = int(host.size)
            if fault.kind != "hang":
                res.gpu_ms_in_collectives_p50 = _gpu_ms_p50(fj, ranks, t0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm / job, ignore_errors=True)
    if incident is not None:
        _fill(res, fault, incident, t0)
    return res


def _at_s_mono(mono: float) -> float:
    """A time.monotonic() moment as a wall time."""
    return time.time() - (time.monotonic() - mono)


def _rings(fj: FakeJob, shm: Path, dirs: dict[int, Path]) -> list[H.RingReader]:
    """Readers of every rank's ring (the agents read their own; the demo only looks), once the
    hooks made them: a ring a rank removes at its exit stays readable through its reader."""
    job = fj.spec.job_id
    paths = [H.ring_path(dirs.get(r, shm), job, r) for r in range(fj.spec.world_size)]
    deadline = time.monotonic() + START_TIMEOUT_S
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline or not fj.running():
            raise TimeoutError(f"the job's rings did not appear: {[str(p) for p in paths]}")
        time.sleep(0.05)
    return [H.RingReader(p) for p in paths]


def _job_after(fj: FakeJob, readers: list[H.RingReader], fault: DemoFault, out: TextIO
               ) -> tuple[int, bool]:
    """Iterations every rank completed once the validation ended (all its ranks running again:
    those of a dead agent at their lease's end), or since now for a hang; and whether every
    rank process is alive (or finished cleanly)."""
    if fault.validates:
        deadline = time.monotonic() + RESUME_WAIT_S
        while control_totals(readers)["parked"] and time.monotonic() < deadline:
            time.sleep(0.05)
    since = time.monotonic_ns()
    end = time.monotonic() + (AFTER_S if fault.validates else 2.0)
    done = 0
    while time.monotonic() < end and fj.running():
        done = min(sum(1 for x in fj.iterations(r) if x.start_ns >= since)
                   for r in range(fj.spec.world_size))
        if done >= AFTER_ITERS:
            break
        time.sleep(0.2)
    alive = all(p.poll() in (None, 0) for p in fj.procs)
    print(f"        after the {'validation' if fault.validates else 'fault'}: every rank "
          f"completed {done} more iteration(s); the job is {'alive' if alive else 'DEAD'}",
          file=out, flush=True)
    return done, alive


def _wait(stack: Stack, base: str, job: str, fault: DemoFault, t0: float, timeout_s: float,
          out: TextIO) -> dict[str, Any] | None:
    """The incident that names the fault once settled; else, at the deadline, the newest one
    (or None). Raises if a service died."""
    watch = _Watch(out, t0)
    rows: list[dict[str, Any]] = []
    while time.time() - t0 < timeout_s:
        if stack.dead():
            raise RuntimeError(f"service(s) {', '.join(stack.dead())} exited; see "
                               f"{stack.settings.data_dir}/logs")
        rows = _incidents(base, job)
        watch.show(rows)
        done = [r for r in rows if _settled(fault, r)]
        if done:
            return done[0]
        time.sleep(0.25)
    named = [r for r in rows if fault.names_culprit(r["culprit"] or {})]
    rest = named or sorted(rows, key=lambda r: r["opened_at"])
    return rest[-1] if rest else None


def _fill(res: DemoResult, fault: DemoFault, incident: dict[str, Any], t0: float) -> None:
    culprit = incident["culprit"] or {}
    res.validation_outcome = ((incident.get("evidence") or {}).get("validation") or {}).get(
        "outcome")
    res.incident_id = incident["id"]
    res.kind = incident["kind"]
    res.ranks = list(culprit.get("ranks") or [])
    res.links = [list(x) for x in culprit.get("link_ranks") or []]
    res.detected_s = round(_at_s(incident["opened_at"]) - t0, 2)
    for entry in incident.get("timeline") or []:
        if entry["stage"] == "validated":
            res.validated = (entry.get("detail") or {}).get("verdict")
        if res.localized_s is None and fault.names_culprit(_entry_culprit(entry)):
            res.localized_s = round(_at_s(entry["at"]) - t0, 2)
    res.ok = fault.kind_ok(res.kind) and fault.names_culprit(culprit) and (
        fault.kind == "hang" or fault.outcome_ok(res.validation_outcome))
    if fault.kind in ("grouped", "bench-peer-dies"):  # never harm the job
        res.ok = res.ok and bool(res.job_alive) and (res.job_iterations_after or 0) >= AFTER_ITERS
    if fault.kind == "grouped":  # the ranks parked at the groups' boundary: the checks ran
        res.ok = res.ok and res.validated is not None


def report(res: DemoResult, fault: DemoFault, out: TextIO | None = None) -> int:
    """The summary and the RESULT line; the exit status (0 when the fault was named)."""
    out = out or sys.stdout
    if res.kind is None:
        print(f"  [4/4] FAILED: no incident for job {res.job} within the time limit (expected "
              f"{fault.expects()})", file=out)
    elif res.ok:
        print(f"  [4/4] found {res.kind}: {_culprit_text(_named(res))}; "
              f"incident opened {res.detected_s:.1f} s and named the culprit "
              f"{res.localized_s:.1f} s after the fault began", file=out)
    else:
        print(f"  [4/4] FAILED: the incident says {res.kind}, ranks {res.ranks}, links "
              f"{res.links}, validation {res.validated or res.validation_outcome}; job alive "
              f"{res.job_alive}, {res.job_iterations_after} iterations after; the fault was "
              f"{fault.expects()}", file=out)
    if res.validation_outcome is not None:
        print(f"        the validation: {res.validation_outcome}", file=out)
    if fault.kind in ("grouped", "bench-peer-dies") and res.job_alive is not None:
        print(f"        the job afterwards: {'alive' if res.job_alive else 'DEAD'}, "
              f"{res.job_iterations_after} iterations on every rank since the validation ended; "
              f"benchmark communicators aborted {res.bench_comms_aborted}, pauses cut at the "
              f"job's timeout {res.pauses_shortened}", file=out)
    if res.host_ms_in_nccl_p99 is not None:
        gpu = (f"the hung all-reduce stayed pending on the GPU for {res.detected_s:.1f} s until "
               f"the hang was called" if fault.kind == "hang" and res.detected_s is not None
               else f"on the GPU the collectives took {res.gpu_ms_in_collectives_p50} ms "
               f"(median since the fault)")
        print(f"        host time inside NCCL calls: median {res.host_ms_in_nccl_p50:.3f} ms, "
              f"p99 {res.host_ms_in_nccl_p99:.3f} ms over "
              f"{res.host_calls} calls, while {gpu}: NCCL calls only enqueue work, so the "
              f"system reads the GPU timeline", file=out)
    print("RESULT " + json.dumps(asdict(res)), file=out, flush=True)
    return 0 if res.ok else 1


def _named(res: DemoResult) -> dict[str, Any]:
    if res.links:
        return {"link_ranks": res.links}
    if res.kind == "compute_slow":
        return {"compute_ranks": res.ranks}
    return {"ranks": res.ranks}


def run_demo(settings: Settings, *, fault: FaultKind = "slow", ranks: int = 4,
             rank: int | None = None, factor: float | None = None, at: int = 100,
             port: int | None = None, timeout_s: float = 60.0) -> int:
    """``greyhound demo``: the stack on embedded servers (unless URLs are set), one fault, the
    report. Bad options end with SystemExit and the reason."""
    try:
        chosen = make_fault(fault, ranks=ranks, rank=rank, factor=factor)
    except ValueError as exc:
        raise SystemExit(f"greyhound demo: {exc}") from None
    if at < 10:
        raise SystemExit(f"greyhound demo: --at must be >= 10 (the detectors learn the healthy "
                         f"iteration first), got {at}")
    # The demo reads its incident over REST on loopback without a token.
    api = ApiSettings(api_anonymous_role="viewer")
    port = port or api.api_port
    tracker = TrackerSettings()
    floor = min(tracker.hang_floor_s, DEMO_HANG_FLOOR_S) if fault == "hang" else None
    print(f"greyhound demo --fault {fault}: {chosen.expects()} expected", flush=True)
    print("  [1/4] building native/ (hook, fake NCCL/CUDA, workload) ...", flush=True)
    native_build_dir()
    print(f"  [2/4] starting embedded NATS + Postgres (unless URLs are set) and the services; data "
          f"and logs in {settings.data_dir}", flush=True)
    if floor is not None:
        print(f"        the tracker's hang floor is lowered from {tracker.hang_floor_s:g} s to "
              f"{floor:g} s for this demo (GREYHOUND_HANG_FLOOR_S), so it ends in seconds",
              flush=True)
        tracker = tracker.model_copy(update={"hang_floor_s": floor})
    # The fake's GPU is a CPU: validation sizes for it, unless the operator chose others.
    with Stack(settings, port=port, service_settings=(for_cpu_fake(), tracker, api)) as stack:
        wait_api(f"http://127.0.0.1:{port}")
        try:
            res = play(stack, chosen, at=at, timeout_s=timeout_s, hang_floor_s=floor)
        except (TimeoutError, RuntimeError) as exc:
            print(f"  FAILED: {exc}", flush=True)
            print("RESULT " + json.dumps(asdict(DemoResult(fault, chosen.line(), ""))), flush=True)
            return 1
    return report(res, chosen)
