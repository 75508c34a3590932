"""What a GPU's own health (NVML samples) says about an incident, in findings and in words.

Timing names the slow rank; only the GPU can say why: held down by heat, a power cap or a
hardware slowdown (its throttle reasons, its SM clock against its peers'), or stopped by an Xid
error, uncorrectable ECC errors or NVLink errors. Pure: samples are plain mappings (the agents'
GpuSample fields: index, host, ranks, sm_clock_mhz, throttle, temperature_c, power_w,
ecc_uncorrected, nvlink_errors, pcie_replays, xids), findings are dataclasses.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Sample = Mapping[str, Any]

# Throttle reasons that slow a busy GPU down (idle, application clocks, sync boost and display
# settings are not faults), and how the words say them.
SLOWING = {
    "hw_thermal": "thermally throttled",
    "sw_thermal": "thermally throttled",
    "hw_slowdown": "in hardware slowdown",
    "hw_power_brake": "power-braked",
    "sw_power_cap": "power-capped",
    "board_limit": "held down by a board limit",
    "reliability": "held down for reliability",
}
# A few Xids whose meaning is worth saying (NVIDIA's Xid catalogue).
XID_NAMES = {
    13: "graphics engine exception", 31: "GPU memory page fault", 43: "GPU stopped processing",
    45: "preemptive cleanup", 48: "double-bit ECC error", 61: "internal micro-controller halt",
    62: "internal micro-controller halt", 63: "ECC page retirement",
    64: "ECC page retirement failure", 74: "NVLink error", 79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate", 94: "contained ECC error",
    95: "uncontained ECC error", 119: "GSP RPC timeout", 120: "GSP error",
}
LOW_CLOCK = 0.85  # an SM clock under this share of its peers' median is low
MAX_SAMPLES = 16  # samples kept as evidence per incident


@dataclass(frozen=True)
class GpuFinding:
    """One GPU's explanation: ``kind`` is throttled, low_clock, xid, ecc or nvlink."""

    kind: str
    index: int
    host: str
    ranks: list[int]
    words: str
    sample: dict[str, Any] = field(default_factory=dict)


def _where(s: Sample) -> str:
    ranks = list(s.get("ranks") or [])
    who = f" (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks[:8]))})" if ranks else ""
    return f"GPU {s.get('index')} on {s.get('host') or '?'}{who}"


def _peer_clock(samples: Sequence[Sample], suspects: set[int]) -> float | None:
    """Median SM clock of the GPUs that run none of the suspect ranks; None without peers."""
    clocks = [float(s["sm_clock_mhz"]) for s in samples if s.get("sm_clock_mhz") is not None
              and not suspects & set(s.get("ranks") or [])]
    return statistics.median(clocks) if clocks else None


def explain_slow(samples: Sequence[Sample], suspects: Sequence[int], *,
                 low_clock: float = LOW_CLOCK) -> list[GpuFinding]:
    """Findings for the GPUs of ``suspects`` (compute stragglers): a slowing throttle reason,
    or an SM clock under ``low_clock`` x its peers' median (a peer is a GPU of the job that runs
    no suspect rank). A GPU that reports neither gets no finding: its health does not explain
    the slowdown."""
    want = set(suspects)
    peer = _peer_clock(samples, want)
    out: list[GpuFinding] = []
    for s in samples:
        if not want & set(s.get("ranks") or []):
            continue
        reasons = [r for r in s.get("throttle") or [] if r in SLOWING]
        sm = s.get("sm_clock_mhz")
        low = sm is not None and peer is not None and peer > 0 and sm < low_clock * peer
        if not reasons and not low:
            continue
        facts = []
        if sm is not None:
            facts.append(f"SM clock {sm} MHz" + (f" vs {peer:.0f} MHz on its peers"
                                                 if peer is not None else ""))
        if s.get("temperature_c") is not None:
            facts.append(f"{s['temperature_c']} C")
        if s.get("power_w") is not None:
            facts.append(f"{float(s['power_w']):.0f} W")
        state = " and ".join(dict.fromkeys(SLOWING[r] for r in reasons)) or "running at a low clock"
        out.append(GpuFinding("throttled" if reasons else "low_clock", int(s.get("index", -1)),
                              str(s.get("host") or ""), list(s.get("ranks") or []),
                              f"{_where(s)} is {state} ({'; '.join(facts)})", dict(s)))
    return out


def explain_hang(samples: Sequence[Sample], ranks: Sequence[int], *,
                 now_s: float | None = None) -> list[GpuFinding]:
    """Findings for a hang: Xid events, uncorrectable ECC errors and NVLink errors, on the GPUs
    of ``ranks`` first; when none of those GPUs reports one, any GPU of the job that does (one
    failed GPU stalls every peer of its collectives, and the hang may name the peers)."""
    def errors(s: Sample) -> list[tuple[str, str]]:
        found: list[tuple[str, str]] = []
        for x in list(s.get("xids") or [])[-4:]:
            code = int(x.get("code", -1))
            name = XID_NAMES.get(code)
            ago = (f", {max(0.0, now_s - float(x['ts'])):.0f} s before the incident"
                   if now_s is not None and x.get("ts") is not None else "")
            found.append(("xid", f"Xid {code}" + (f" ({name})" if name else "") + ago))
        if (s.get("ecc_uncorrected") or 0) > 0:
            found.append(("ecc", f"{s['ecc_uncorrected']} uncorrectable ECC error(s)"))
        nv = {k: v for k, v in (s.get("nvlink_errors") or {}).items() if v}
        if nv:
            found.append(("nvlink", "NVLink errors (" + ", ".join(
                f"{k} {v}" for k, v in sorted(nv.items())) + ")"))
        return found

    want = set(ranks)
    mine = [s for s in samples if want & set(s.get("ranks") or []) and errors(s)]
    chosen = mine or [s for s in samples if errors(s)]
    out = []
    for s in chosen:
        errs = errors(s)
        out.append(GpuFinding(errs[0][0], int(s.get("index", -1)), str(s.get("host") or ""),
                              list(s.get("ranks") or []),
                              f"{_where(s)} reported " + "; ".join(w for _, w in errs), dict(s)))
    return out


def explanation(findings: Sequence[GpuFinding], *, limit: int = 4) -> str | None:
    """The findings in one sentence (the first ``limit``); None without findings."""
    if not findings:
        return None
    words = "; ".join(f.words for f in findings[:limit])
    more = len(findings) - limit
    return words + (f"; and {more} more GPU(s)" if more > 0 else "")


def evidence(samples: Sequence[Sample], findings: Sequence[GpuFinding]) -> dict[str, Any]:
    """What an incident keeps: the findings' samples first, then others, at most MAX_SAMPLES,
    and the peers' median SM clock."""
    named = {(f.host, f.index) for f in findings}
    first = [dict(s) for s in samples if (s.get("host"), s.get("index")) in named]
    rest = [dict(s) for s in samples if (s.get("host"), s.get("index")) not in named]
    suspects = {r for f in findings for r in f.ranks}
    return {"findings": [{"kind": f.kind, "index": f.index, "host": f.host, "ranks": f.ranks[:64],
                          "words": f.words} for f in findings[:MAX_SAMPLES]],
            "samples": (first + rest)[:MAX_SAMPLES], "gpus_sampled": len(samples),
            "peer_sm_clock_mhz": _peer_clock(samples, suspects)}
