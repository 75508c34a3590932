#!/usr/bin/env python3
"""Localisation report over the scenario suite: every scenario runs live through the real stack
(agent, NATS, tracker, analyzer, validator, Postgres, REST API), the services knowing nothing of
the faults; the report scores the incidents against the faults the scenario injected.

Per scenario: was each fault found with the right kind and culprit, how many incidents matched no
fault (false incidents), and the virtual time from fault start to localisation. Last line:
``RESULT {json}``.

    .venv/bin/python scripts/localize_report.py [--speed 4] [--only NAME...] [scenarios/suite/*.yaml]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from greyhound.demo import wait_api
from greyhound.sim.live import LiveSimulation
from greyhound.sim.live_run import incident_line, job_id_for
from greyhound.sim.scenario import Scenario, load_scenario
from greyhound.stack import Stack
from services.common.settings import Settings

HANG_KINDS = {"hang_not_entered", "hang_inconsistent", "hang_hardware"}


@dataclass
class Expect:
    """What a correct diagnosis of one injected fault looks like."""

    fault: str
    start_s: float
    end_s: float | None
    kinds: set[str]
    ranks: set[int] = field(default_factory=set)
    nodes: set[int] = field(default_factory=set)
    link: tuple[int, int] | None = None


def expectations(sc: Scenario) -> list[Expect]:
    job = sc.job
    out: list[Expect] = []
    for f in sc.faults:
        end = None if f.duration_s is None else f.start_s + f.duration_s
        if f.kind == "gpu_slow":
            assert f.rank is not None
            out.append(Expect(f.kind, f.start_s, end, {"compute_slow", "mixed_slow"},
                              ranks={f.rank}))
        elif f.kind == "cpu_contention":
            assert f.node is not None
            node_ranks = set(range(f.node * job.gpus_per_node, (f.node + 1) * job.gpus_per_node))
            out.append(Expect(f.kind, f.start_s, end, {"compute_slow", "mixed_slow"},
                              ranks=node_ranks, nodes={f.node}))
        elif f.kind == "link_congestion":
            assert f.nodes is not None
            a, b = sorted(f.nodes)
            out.append(Expect(f.kind, f.start_s, end, {"comm_slow", "mixed_slow"},
                              nodes={a, b}, link=(a, b)))
        else:
            assert f.rank is not None
            out.append(Expect(f.kind, f.start_s, end, {f.kind}, ranks={f.rank}))
    return out


def matches(e: Expect, inc: dict[str, Any]) -> tuple[bool, bool]:
    """(right kind, right culprit) of one incident line for one expectation."""
    kind_ok = inc["kind"] in e.kinds
    ranks, nodes = set(inc["ranks"]), set(inc["nodes"])
    links = {tuple(sorted(x)) for x in inc["links"]}
    if e.link is not None:
        culprit_ok = e.link in links or (not links and bool(nodes) and nodes <= e.nodes)
    elif e.nodes and e.kinds & {"compute_slow"} and len(e.ranks) > 1:  # a whole node
        culprit_ok = bool(ranks) and ranks <= e.ranks
    else:
        culprit_ok = bool(ranks & e.ranks) and len(ranks) <= max(1, len(e.ranks)) * 8
    return kind_ok, culprit_ok


@dataclass
class Row:
    name: str
    gpus: int
    faults: int
    found_kind: int
    found_culprit: int
    false_incidents: int
    localize_s: list[float]
    wall_s: float
    note: str = ""


def run_one(path: Path, stack: Stack, base: str, speed: float | None, settle_s: float) -> Row:
    sc = load_scenario(path)
    job = job_id_for(sc)
    t0 = time.monotonic()
    sim = LiveSimulation(sc, Path(stack.settings.shm_dir), job, speed=speed)
    try:
        sim.run(should_stop=lambda: bool(stack.dead()))
        if stack.dead():
            raise RuntimeError(f"service(s) {stack.dead()} exited during {sc.name}; see "
                               f"{stack.settings.data_dir}/logs")
        deadline = time.monotonic() + 60
        while any(r.lag() for r in sim.rings) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(settle_s)
        r = httpx.get(f"{base}/v1/incidents", params={"job_id": job, "limit": 1000}, timeout=10)
        r.raise_for_status()
        lines = [incident_line(i, sim.virtual_at) for i in r.json()]
    finally:
        sim.close(remove=True)
    exp = expectations(sc)
    used: set[int] = set()
    kinds = culprits = 0
    times: list[float] = []
    for e in exp:
        best = None
        for i, inc in enumerate(lines):
            k, c = matches(e, inc)
            if k and c:
                best = i
                break
            if best is None and (k or c):
                best = i
        if best is None:
            continue
        used.add(best)
        k, c = matches(e, lines[best])
        kinds += k
        culprits += c
        loc = lines[best]["localized_s"]
        if k and c and loc is not None:
            times.append(loc - e.start_s)
    transient_ok = {i for i, inc in enumerate(lines) if inc["kind"] == "slowdown"
                    and any(x.end_s is not None and x.end_s - x.start_s < 10 for x in exp)}
    false = len([i for i in range(len(lines)) if i not in used and i not in transient_ok])
    return Row(sc.name, sc.job.world, len(exp), kinds, culprits, false, times,
               time.monotonic() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="*", type=Path)
    p.add_argument("--speed", type=float, default=4.0,
                   help="virtual seconds per wall second (1 for faithful timings)")
    p.add_argument("--settle", type=float, default=4.0)
    p.add_argument("--hang-floor", type=float, default=20.0,
                   help="hang threshold floor (s): above the validation pause in virtual time")
    p.add_argument("--only", nargs="*", default=None)
    args = p.parse_args(argv)
    paths = args.paths or sorted(Path("scenarios/suite").glob("*.yaml"))
    if args.only:
        paths = [x for x in paths if x.stem in set(args.only)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    rows: list[Row] = []
    # Logs and data stay (under the ignored .greyhound/) so a surprising row can be looked into.
    Path(".greyhound").mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="report-", dir=Path(".greyhound").resolve()))
    print(f"services' logs: {tmp}/data/logs", file=sys.stderr)
    # The simulator reports time inside NCCL in virtual seconds: at 4x a validation pause of
    # ~1.5 s shows as ~6 s, so the hang floor stays above that and below the scenarios' tails.
    settings = Settings(data_dir=tmp / "data", shm_dir=tmp / "shm", hang_floor_s=args.hang_floor)
    with Stack(settings, port=port) as stack:
        base = f"http://127.0.0.1:{port}"
        wait_api(base)
        for n, path in enumerate(paths, 1):
            print(f"[{n}/{len(paths)}] {path.stem} ...", file=sys.stderr, flush=True)
            rows.append(run_one(path, stack, base, args.speed, args.settle))
    print(f"{'scenario':28} {'gpus':>5} {'faults':>6} {'kind':>5} {'culprit':>7} {'false':>5} "
          f"{'localise s':>10}")
    for r in rows:
        loc = f"{max(r.localize_s):.1f}" if r.localize_s else "-"
        print(f"{r.name:28} {r.gpus:5d} {r.faults:6d} {r.found_kind:5d} {r.found_culprit:7d} "
              f"{r.false_incidents:5d} {loc:>10}")
    faults = sum(r.faults for r in rows)
    times = [t for r in rows for t in r.localize_s]
    t256 = [t for r in rows if r.gpus >= 256 for t in r.localize_s]
    result = {
        "scenarios": len(rows), "faults": faults,
        "kind_correct": sum(r.found_kind for r in rows),
        "culprit_correct": sum(r.found_culprit for r in rows),
        "false_incidents": sum(r.false_incidents for r in rows),
        "median_localize_s": statistics.median(times) if times else None,
        "max_localize_s_256": max(t256) if t256 else None, "speed": args.speed,
    }
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
