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

from greyhound.sim.live import LiveSimulation
from greyhound.sim.scenario import load_scenario
from greyhound.sim.score import expectations, matches
from services.api.settings import ApiSettings
from services.common.settings import Settings
from services.tracker.settings import TrackerSettings
from stack.sim_live import incident_line, job_id_for
from stack.up import Stack, wait_api


@dataclass
class FaultResult:
    taxonomy: str
    kind_ok: bool
    culprit_ok: bool
    localize_s: float | None


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
    speed: float  # virtual seconds per wall second the run achieved (the target is --speed)
    detail: list[FaultResult] = field(default_factory=list)


def run_one(path: Path, stack: Stack, base: str, speed: float | None, settle_s: float,
            dump: Path | None = None) -> Row:
    sc = load_scenario(path)
    job = job_id_for(sc)
    t0 = time.monotonic()
    sim = LiveSimulation(sc, Path(stack.settings.shm_dir), job, speed=speed)
    try:
        progress = sim.run(should_stop=lambda: bool(stack.dead()))
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
        if dump is not None:  # the whole incidents (evidence, timeline) for a closer look
            dump.mkdir(parents=True, exist_ok=True)
            (dump / f"{sc.name}.json").write_text(json.dumps(r.json(), indent=1))
    finally:
        sim.close(remove=True)
    exp = expectations(sc)
    used: set[int] = set()
    kinds = culprits = 0
    times: list[float] = []
    detail: list[FaultResult] = []
    for e in exp:
        best = None
        for i, inc in enumerate(lines):
            if inc["detected_s"] < e.start_s - 2.0:  # an earlier episode's incident
                continue
            k, c = matches(e, inc)
            if k and c:
                best = i
                break
            if best is None and (k or c):
                best = i
        if best is None:
            detail.append(FaultResult(e.taxonomy, False, False, None))
            continue
        used.add(best)
        k, c = matches(e, lines[best])
        kinds += k
        culprits += c
        loc = lines[best]["localized_s"]
        took = loc - e.start_s if k and c and loc is not None else None
        if took is not None:
            times.append(took)
        detail.append(FaultResult(e.taxonomy, k, c, took))
    transient_ok = {i for i, inc in enumerate(lines) if inc["kind"] == "slowdown"
                    and any(x.end_s is not None and x.end_s - x.start_s < 10 for x in exp)}
    false = len([i for i in range(len(lines)) if i not in used and i not in transient_ok])
    return Row(sc.name, sc.job.world, len(exp), kinds, culprits, false, times,
               time.monotonic() - t0, progress.speed, detail)


KIND_ORDER = ("compute_slow", "comm_slow", "mixed_slow", "hang_not_entered", "hang_inconsistent",
              "hang_hardware")


def per_kind(rows: list[Row]) -> dict[str, dict[str, Any]]:
    """Faults scored under each of the six kinds: how many, right kind, right culprit, and the
    virtual seconds from fault start to localisation (when both were right)."""
    out: dict[str, dict[str, Any]] = {}
    for k in KIND_ORDER:
        res = [d for r in rows for d in r.detail if d.taxonomy == k]
        took = [d.localize_s for d in res if d.localize_s is not None]
        out[k] = {"faults": len(res), "kind_correct": sum(d.kind_ok for d in res),
                  "culprit_correct": sum(d.culprit_ok for d in res),
                  "median_localize_s": round(statistics.median(took), 2) if took else None,
                  "max_localize_s": round(max(took), 2) if took else None}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="*", type=Path)
    p.add_argument("--speed", type=float, default=4.0,
                   help="virtual seconds per wall second (1 for faithful timings)")
    p.add_argument("--settle", type=float, default=4.0)
    p.add_argument("--hang-floor", type=float, default=20.0,
                   help="hang threshold floor (s): above the validation pause in virtual time")
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--dump", type=Path, default=None,
                   help="write each scenario's incidents (full JSON) into this directory")
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
    settings = Settings(data_dir=tmp / "data", shm_dir=tmp / "shm")
    hang_floor = TrackerSettings(hang_floor_s=args.hang_floor)
    anonymous = ApiSettings(api_anonymous_role="viewer")  # incidents read over REST, no token
    with Stack(settings, port=port, service_settings=(hang_floor, anonymous)) as stack:
        base = f"http://127.0.0.1:{port}"
        wait_api(base)
        for n, path in enumerate(paths, 1):
            print(f"[{n}/{len(paths)}] {path.stem} ...", file=sys.stderr, flush=True)
            rows.append(run_one(path, stack, base, args.speed, args.settle, args.dump))
    print(f"{'scenario':28} {'gpus':>5} {'faults':>6} {'kind':>5} {'culprit':>7} {'false':>5} "
          f"{'localise s':>10} {'speed':>6}")
    for r in rows:
        loc = f"{max(r.localize_s):.1f}" if r.localize_s else "-"
        print(f"{r.name:28} {r.gpus:5d} {r.faults:6d} {r.found_kind:5d} {r.found_culprit:7d} "
              f"{r.false_incidents:5d} {loc:>10} {r.speed:6.2f}")
    by_kind = per_kind(rows)
    print(f"\n{'kind':20} {'faults':>6} {'kind':>5} {'culprit':>7} {'median s':>9} {'max s':>7}")
    for k, v in by_kind.items():
        med = "-" if v["median_localize_s"] is None else f"{v['median_localize_s']:.1f}"
        mx = "-" if v["max_localize_s"] is None else f"{v['max_localize_s']:.1f}"
        print(f"{k:20} {v['faults']:6d} {v['kind_correct']:5d} {v['culprit_correct']:7d} "
              f"{med:>9} {mx:>7}")
    healthy = [r for r in rows if r.faults == 0]
    print(f"healthy runs: {len(healthy)}, incidents on them: "
          f"{sum(r.false_incidents for r in healthy)}")
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
        "min_achieved_speed_256": min((r.speed for r in rows if r.gpus >= 256), default=None),
        "false_incidents_healthy": sum(r.false_incidents for r in healthy),
        "by_kind": by_kind,
    }
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
