import json

import numpy as np
import pytest

from greyhound.core.detector import Detection, detect_many
from greyhound.core.levels import stage_view
from greyhound.traces.events import score_events
from greyhound.traces.generator import STACK_MAX, STACK_WINDOW, GeneratorConfig, generate_traces
from greyhound.traces.hindsight import label_by_hindsight
from greyhound.traces.labels import Episode, Trace
from greyhound.traces.metrics import score
from greyhound.traces.realistic import RealisticConfig, generate_realistic_traces
from greyhound.traces.textio import TraceFormatError, load_traces, parse_series, write_traces


def test_generator_is_seeded_and_labels_are_consistent():
    a = generate_traces(20, seed=3, cfg=GeneratorConfig(min_len=500, max_len=900))
    b = generate_traces(20, seed=3, cfg=GeneratorConfig(min_len=500, max_len=900))
    assert [t.name for t in a] == [t.name for t in b]
    assert all(np.array_equal(x.times, y.times) for x, y in zip(a, b, strict=True))
    assert 0 < sum(t.positive for t in a) < 20
    for t in a:
        assert np.all(t.times > 0)
        for e in t.episodes:
            assert 0 <= e.start <= e.onset < e.end <= len(t.times)
            assert 1.12 <= e.factor <= 3.0 and e.end - e.start >= 8
        assert {"warmup", "gc"} <= {n.kind for n in t.noise}
    every = {n.kind for t in a for n in t.noise}
    assert {"checkpoint", "eval", "dataloader", "transient<=2it"} <= every


def test_stacked_sub_threshold_noise_stays_under_10_percent():
    """Steps and long transients, each under 10%, never stack into one rise that a fail-slow
    would make (the labels would call it healthy): within any STACK_WINDOW iterations their
    product rises at most STACK_MAX. Without the cap, 11-15% stacks were drawn in about one
    healthy job in a hundred."""
    stacked = 0
    for t in generate_traces(200, seed=11):
        n = len(t.times)
        level = np.ones(n)
        for e in t.noise:
            if e.kind in ("step<10%", "transient<10%"):
                level[e.start:e.end] *= e.factor
                stacked += 1
        floor = np.array([level[max(0, i - STACK_WINDOW):i + 1].min() for i in range(n)])
        assert (level / floor).max() <= STACK_MAX + 1e-9, t.name
    assert stacked > 200  # the noise is still there


def test_abrupt_episode_really_slows_the_trace():
    traces = generate_traces(40, seed=4, cfg=GeneratorConfig(min_len=600, max_len=900))
    for t in traces:
        for e in t.episodes:
            if e.onset == e.start and e.end - e.start >= 30:
                inside = np.median(t.times[e.start:e.start + 20])
                before = np.median(t.times[max(0, e.start - 40):e.start])
                assert inside / before > 1.05


def test_scores_follow_the_paper_definitions():
    pos = Trace("p", np.ones(100), [Episode(50, 80, 1.5, 50)])
    neg = Trace("n", np.ones(100))
    hit = Detection(51, 53, "slowdown", 1.0, 1.5)
    s = score([pos, neg], [[hit], []])
    assert (s.accuracy, s.fpr, s.fnr, s.episode_recall, s.median_latency) == (1.0, 0.0, 0.0, 1.0, 3)
    s = score([pos, neg], [[], [hit]])
    assert (s.accuracy, s.fpr, s.fnr, s.false_alarms) == (0.0, 1.0, 1.0, 1)


def test_write_and_load_round_trip(tmp_path):
    traces = generate_traces(5, seed=5, cfg=GeneratorConfig(min_len=200, max_len=300))
    write_traces(tmp_path, traces)
    back = load_traces(tmp_path)
    assert [t.name for t in back] == [t.name for t in traces]
    for x, y in zip(traces, back, strict=True):
        assert np.allclose(x.times, y.times, rtol=1e-8)
        assert x.episodes == y.episodes


def test_parse_series_names_the_bad_line():
    assert parse_series("0.5\n\n# comment\n0.25  # inline\n").tolist() == [0.5, 0.25]
    with pytest.raises(TraceFormatError, match=r"f:2: not a number"):
        parse_series("0.5\nxyz\n", "f")
    with pytest.raises(TraceFormatError, match=r"f:1: negative"):
        parse_series("-1\n", "f")


def test_bocdv_meets_targets_on_a_small_hostile_set():
    """A quick slice of the report: the full 400-trace run lives in scripts/detect_report.py."""
    traces = generate_traces(60, seed=11, cfg=GeneratorConfig(min_len=600, max_len=1500))
    dets = detect_many([t.times for t in traces], "bocd-v")
    s = score(traces, [stage_view(d, "confirmed") for d in dets])
    assert s.fpr <= 0.05 and s.fnr <= 0.05
    assert s.median_latency <= 5.0
    assert score(traces, [stage_view(d, "suspected") for d in dets]).median_latency <= 3.0
    base = score(traces, detect_many([t.times for t in traces], "bocd"))
    assert base.fpr > s.fpr


# Traces labelled by hindsight, as the recorded ones are.

def test_hindsight_labels_episodes_short_runs_and_near_threshold_stretches():
    t0 = 0.02
    x = np.full(1000, t0 * 0.97)
    x[200:260] = t0 * 1.5       # an episode
    x[400:405] = t0 * 1.5       # five slow iterations: too short, ignored
    x[600:640] = t0 * 1.09      # near the threshold: ignored
    x[800:840] = t0 * 1.13      # a would-be episode under 1.15: ignored
    x[300] = t0 * 30.0          # a spike is neither
    episodes, ignore = label_by_hindsight(x, t0, warmup=50)
    assert [(e.start, e.end) for e in episodes] == [(200, 260)]
    assert episodes[0].factor == pytest.approx(1.5)
    assert (0, 50) in ignore and (400, 405) in ignore
    assert any(a <= 600 and b >= 640 for a, b in ignore)
    assert any(a <= 800 and b >= 840 for a, b in ignore)
    assert not any(a <= 300 < b for a, b in ignore)


def test_realistic_generator_is_seeded_and_its_labels_are_the_hindsight_ones():
    a = generate_realistic_traces(6, seed=3, cfg=RealisticConfig(min_len=800, max_len=1200))
    b = generate_realistic_traces(6, seed=3, cfg=RealisticConfig(min_len=800, max_len=1200))
    assert all(np.array_equal(x.times, y.times) for x, y in zip(a, b, strict=True))
    for t in a:
        assert np.all(t.times > 0) and t.t0 is not None and t.onset_tolerance > 0
        episodes, ignore = label_by_hindsight(t.times, t.t0, warmup=next(
            (n.end for n in t.noise if n.kind == "warmup"), 0))
        assert episodes == t.episodes and ignore == t.ignore
        for e in t.episodes:
            assert e.end - e.start >= 8 and e.factor >= 1.15
    kinds = {n.kind for t in a for n in t.noise}
    assert {"plateau", "eval", "stall"} <= kinds
    assert any(k.startswith("slow-") for k in kinds)


def test_event_scores_follow_the_recorded_traces_rules():
    t = Trace("r", np.ones(1000), [Episode(500, 600, 1.5, 500)], ignore=[(100, 110)], t0=1.0,
              onset_tolerance=6)
    found = Detection(495, 503, "slowdown", 1.0, 1.5)            # 5 early: within tolerance
    late = Detection(511, 512, "slowdown", 1.0, 1.5)             # index past start + 10
    ignored = Detection(105, 110, "slowdown", 1.0, 1.2)          # in an ignored stretch
    after = Detection(604, 606, "slowdown", 1.0, 1.2)            # within 5 after the end
    alarm = Detection(300, 304, "slowdown", 1.0, 1.2)
    recovery = Detection(300, 304, "recovery", 1.2, 1.0)         # recoveries are not alarms
    s = score_events([t], [[found, late, ignored, after, alarm, recovery]])
    assert (s.found, s.recall, s.median_latency, s.false_alarms) == (1, 1.0, 3.0, 1)
    assert s.healthy_iterations == 1000 - 10 - (605 - 494)
    assert s.fa_per_10k == pytest.approx(1e4 / s.healthy_iterations)
    miss = score_events([t], [[late]])
    assert (miss.found, miss.false_alarms) == (0, 0)


def test_recorded_label_layout_loads(tmp_path):
    (tmp_path / "r.txt").write_text("0.02\n" * 50)
    (tmp_path / "labels.json").write_text(json.dumps({"r": {
        "episodes": [[10, 30, 1.5]], "ignore": [[0, 5]], "t0": 0.02, "onset_tolerance": 6}}))
    (t,) = load_traces(tmp_path)
    assert t.episodes == [Episode(10, 30, 1.5, 10)] and t.ignore == [(0, 5)]
    assert t.t0 == 0.02 and t.onset_tolerance == 6
    write_traces(tmp_path / "out", [t])
    (back,) = load_traces(tmp_path / "out")
    assert (back.episodes, back.ignore, back.t0) == (t.episodes, t.ignore, t.t0)


def test_bocdv_meets_the_event_targets_on_a_small_realistic_set():
    """A quick slice of the report's realistic-noise rows (scripts/detect_report.py)."""
    traces = generate_realistic_traces(30, seed=7)
    dets = detect_many([t.times for t in traces], "bocd-v")
    s = score_events(traces, [stage_view(d, "confirmed") for d in dets])
    assert s.episodes >= 40
    assert s.recall >= 0.85 and s.fa_per_10k <= 2.0 and s.median_latency <= 5.0, s
