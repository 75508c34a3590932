"""Validation verdicts: which GPU or link is slow, measured while the job is paused.

The validator runs GEMM tests on the suspect GPUs and P2P send/recv rounds over the job's own
communicators; these functions turn the timings into a decision. Each GPU (link) is compared with
the median of its peers, because every GPU (link) ran the same work with the same bytes, so only a
degraded one stands out. When nothing stands out any more, the fail-slow ended during the check:
the suspicion is closed as transient rather than acted upon.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

Evidence = dict[str, float | int | str | list[object]]
VerdictKind = Literal["compute_slow", "comm_slow", "mixed_slow", "transient"]
# Slower than the median of its peers by more than this is slow (the paper's sizes on real
# GPUs; the validator's setting defaults to it).
THRESHOLD = 0.15


@dataclass(frozen=True, slots=True)
class GemmVerdict:
    slow_gpus: list[int]
    median_s: float
    ratios: dict[int, float]
    evidence: Evidence = field(default_factory=dict)

    @property
    def transient(self) -> bool:
        return not self.slow_gpus


@dataclass(frozen=True, slots=True)
class LinkVerdict:
    slow_links: list[tuple[int, int]]
    ratios: dict[tuple[int, int], float]
    evidence: Evidence = field(default_factory=dict)

    @property
    def transient(self) -> bool:
        return not self.slow_links


@dataclass(frozen=True, slots=True)
class ValidationVerdict:
    kind: VerdictKind
    gpus: list[int]
    links: list[tuple[int, int]]
    evidence: Evidence = field(default_factory=dict)


def judge_gemm(
    times_s: Mapping[int, float],
    *,
    threshold: float = THRESHOLD,
    baseline_s: float | None = None,
) -> GemmVerdict:
    """GPUs whose GEMM time exceeds the reference by more than `threshold`.

    The reference is the median over the tested GPUs; a known healthy time (`baseline_s`) lowers
    it, so that a group where most GPUs are throttled is still caught.
    """
    if not times_s:
        return GemmVerdict([], float("nan"), {}, {"gpus_tested": 0})
    gpus = np.fromiter(times_s.keys(), dtype=np.int64, count=len(times_s))
    t = np.fromiter(times_s.values(), dtype=np.float64, count=len(times_s))
    median = float(np.median(t))
    reference = min(median, baseline_s) if baseline_s is not None else median
    ratio = t / reference
    slow = ratio > 1.0 + threshold
    order = np.argsort(-ratio[slow], kind="stable")
    slow_gpus = [int(g) for g in gpus[slow][order]]
    evidence: Evidence = {
        "gpus_tested": len(times_s),
        "median_s": median,
        "reference_s": float(reference),
        "threshold": threshold,
        "slow_gpus": list(slow_gpus),
        "slow_times_s": [float(times_s[g]) for g in slow_gpus],
        "max_ratio": float(ratio.max()),
    }
    ratios = {int(g): float(r) for g, r in zip(gpus, ratio, strict=True)}
    return GemmVerdict(slow_gpus, median, ratios, evidence)


def judge_links(
    times_s: Mapping[tuple[int, int], Sequence[float]],
    *,
    threshold: float = THRESHOLD,
    baseline_s: Sequence[float] | None = None,
) -> LinkVerdict:
    """Links whose P2P times exceed the median link's by more than `threshold`.

    Each link carries the same sequence of tests (e.g. 16/32/64 MB, 3 times each), so position j
    of every sequence is comparable: each time is divided by the median over links at j (or the
    healthy `baseline_s[j]` when that is lower) and a link's score is the median of its ratios,
    which weighs small and large messages alike. A median, not a mean: a congested link is slow
    in every test, while one test delayed by something else (a process descheduled on a busy
    host, a GPU clock ramp) must not make a healthy link slow; a mean let one sample of 9 at 10x
    name a healthy link.
    """
    if not times_s:
        return LinkVerdict([], {}, {"links_tested": 0})
    links = list(times_s.keys())
    lengths = {len(v) for v in times_s.values()}
    if len(lengths) != 1:
        raise ValueError("every link must run the same sequence of tests")
    t = np.asarray([list(times_s[k]) for k in links], dtype=np.float64)
    if t.shape[1] == 0:
        raise ValueError("each link needs at least one timing")
    reference = np.median(t, axis=0)
    if baseline_s is not None:
        base = np.asarray(baseline_s, dtype=np.float64)
        if base.shape != reference.shape:
            raise ValueError("baseline_s must have one value per test position")
        reference = np.minimum(reference, base)
    score = np.median(t / reference, axis=1)
    slow = np.flatnonzero(score > 1.0 + threshold)
    slow = slow[np.argsort(-score[slow], kind="stable")]
    slow_links = [(int(links[i][0]), int(links[i][1])) for i in slow]
    evidence: Evidence = {
        "links_tested": len(links),
        "tests_per_link": int(t.shape[1]),
        "median_link_s": [float(x) for x in np.median(t, axis=0)],
        "threshold": threshold,
        "slow_links": [list(link) for link in slow_links],
        "slow_ratios": [float(score[i]) for i in slow],
        "max_ratio": float(score.max()),
    }
    ratios = {(int(a), int(b)): float(s) for (a, b), s in zip(links, score, strict=True)}
    return LinkVerdict(slow_links, ratios, evidence)


def judge_links_by_class(
    times_s: Mapping[tuple[int, int], Sequence[float]],
    link_class: Mapping[tuple[int, int], str],
    *,
    reference: Collection[tuple[int, int]] = (),
    threshold: float = THRESHOLD,
) -> LinkVerdict:
    """Like :func:`judge_links`, but a link is only compared with links of its own class.

    An NVLink hop and a network hop differ by an order of magnitude when both are healthy, so a
    median over both says nothing. Within a class, the median can be the congested link itself
    when every tested hop of that class crosses it (a suspect group spanning two nodes): links of
    a comparable healthy group (``reference``) give each class its healthy time. Only the
    non-reference links are judged.
    """
    suspects = [k for k in times_s if k not in reference]
    if not suspects:
        return LinkVerdict([], {}, {"links_tested": 0})
    slow: list[tuple[int, int]] = []
    ratios: dict[tuple[int, int], float] = {}
    slow_ratio: dict[tuple[int, int], float] = {}
    evidence: Evidence = {"links_tested": len(suspects), "reference_links": len(times_s) - len(suspects),
                          "threshold": threshold}
    for cls in sorted({link_class[k] for k in suspects}):
        mine = {k: times_s[k] for k in suspects if link_class[k] == cls}
        refs = [times_s[k] for k in reference if k in times_s and link_class.get(k) == cls]
        base = [float(x) for x in np.median(np.asarray(refs, dtype=np.float64), axis=0)] if refs else None
        v = judge_links(mine, threshold=threshold, baseline_s=base)
        slow += v.slow_links
        ratios.update(v.ratios)
        slow_ratio.update({k: v.ratios[k] for k in v.slow_links})
        evidence[f"{cls}_links_tested"] = len(mine)
        evidence[f"{cls}_median_link_s"] = v.evidence["median_link_s"]
        if base is not None:
            evidence[f"{cls}_reference_link_s"] = list[object](base)
    slow.sort(key=lambda k: -slow_ratio[k])
    evidence["slow_links"] = [list(k) for k in slow]
    evidence["slow_ratios"] = [slow_ratio[k] for k in slow]
    evidence["max_ratio"] = max(ratios.values())
    return LinkVerdict(slow, ratios, evidence)


def combine_verdicts(gemm: GemmVerdict | None, links: LinkVerdict | None) -> ValidationVerdict:
    """One decision from whichever checks ran: slow GPUs, slow links, both, or neither (transient)."""
    gpus = list(gemm.slow_gpus) if gemm is not None else []
    slow_links = list(links.slow_links) if links is not None else []
    kind: VerdictKind
    if gpus and slow_links:
        kind = "mixed_slow"
    elif gpus:
        kind = "compute_slow"
    elif slow_links:
        kind = "comm_slow"
    else:
        kind = "transient"
    evidence: Evidence = {"gemm_checked": int(gemm is not None), "links_checked": int(links is not None)}
    if gemm is not None:
        evidence.update({f"gemm_{k}": v for k, v in gemm.evidence.items()})
    if links is not None:
        evidence.update({f"p2p_{k}": v for k, v in links.evidence.items()})
    return ValidationVerdict(kind, gpus, slow_links, evidence)
