import numpy as np
import pytest

from greyhound.core.period import IterationSegmenter, find_period, lag_agreement, whole_periods

PATTERN = np.array([5, 5, 5, 7, 9, 5, 5, 11, 13, 13, 2], dtype=np.int64)


def _stream(seed: int, iters: int = 300, pattern: np.ndarray = PATTERN, drop: int = 0,
            extra: int = 0, t0: float = 0.0):
    """Calls at fixed fractions of each iteration; returns keys, enter_ns, true iteration times."""
    rng = np.random.default_rng(seed)
    p = len(pattern)
    frac = np.sort(rng.uniform(0.0, 0.9, p))
    frac[0] = 0.0
    dur = 0.1 * np.exp(rng.normal(0.0, 0.05, iters))
    starts = t0 + np.concatenate([[0.0], np.cumsum(dur)[:-1]])
    t = (starts[:, None] + frac[None, :] * dur[:, None]).reshape(-1)
    k = np.tile(pattern, iters)
    keep = np.ones(k.size, dtype=bool)
    keep[rng.choice(k.size, drop, replace=False)] = False
    k, t = k[keep], t[keep]
    if extra:
        at = np.sort(rng.choice(k.size - 1, extra, replace=False))
        k = np.insert(k, at + 1, 99)
        t = np.insert(t, at + 1, t[at] + 1e-6)
    return k, (t * 1e9).astype(np.int64), dur


def test_find_period_exact_and_with_glitches():
    k, _, _ = _stream(0)
    assert find_period(k) == len(PATTERN)
    k, _, _ = _stream(1, drop=4, extra=3)
    assert find_period(k) == len(PATTERN)


def test_glitches_break_the_plain_agreement_but_not_the_block_median():
    k, _, _ = _stream(2, iters=30, drop=3)
    lag = len(PATTERN)
    plain = float(np.mean(k[:-lag] == k[lag:]))
    assert plain < 0.95 < lag_agreement(k, lag)


def test_no_period_in_random_calls():
    rng = np.random.default_rng(3)
    assert find_period(rng.integers(0, 50, 2000)) is None


@pytest.mark.parametrize(("drop", "extra"), [(0, 0), (6, 0), (0, 6), (5, 5)])
def test_iteration_time_error_below_one_percent(drop, extra):
    k, t, dur = _stream(4, drop=drop, extra=extra)
    seg = IterationSegmenter()
    out = []
    for a in range(0, k.size, 37):
        out += seg.feed(k[a:a + 37], t[a:a + 37], t[a:a + 37])
    assert seg.period == len(PATTERN)
    est = np.array([it.duration_s for it in out])
    assert est.size >= len(dur) - 3
    # The primary anchor sits at some fixed phase: compare with the truth at that phase.
    truth = dur[: est.size]
    errs = [np.median(np.abs(est - np.roll(dur, -s)[: est.size]) / truth) for s in range(3)]
    assert min(errs) <= 0.01
    assert [it.index for it in out] == list(range(len(out)))


def test_segmenter_relearns_when_the_pattern_changes():
    k1, t1, _ = _stream(5, iters=100)
    other = np.array([21, 22, 23, 21, 24], dtype=np.int64)
    k2, t2, _ = _stream(6, iters=100, pattern=other, t0=t1[-1] / 1e9 + 0.1)
    seg = IterationSegmenter()
    seg.feed(k1, t1, t1)
    assert seg.period == len(PATTERN)
    out = seg.feed(k2, t2, t2)
    assert seg.period == len(other)
    assert out and abs(out[-1].duration_s - 0.1) < 0.03


# A later pipeline stage: a receive and a send per micro-batch, one all-reduce per iteration.
STAGE = np.array([1, 2] * 8 + [0], dtype=np.int64)


def _segment(k: np.ndarray, t: np.ndarray) -> tuple[IterationSegmenter, np.ndarray]:
    seg = IterationSegmenter()
    out = []
    for a in range(0, k.size, 37):
        out += seg.feed(k[a:a + 37], t[a:a + 37], t[a:a + 37])
    return seg, np.array([it.duration_s for it in out])


def test_a_sub_period_that_a_rare_op_spoils_is_not_the_period():
    """[1, 2] agrees with itself at lag 2 on 15 of 17 calls, and the block median skips the
    two: without the whole-period check the segmenter cut each iteration into micro-batches."""
    k, t, dur = _stream(7, pattern=STAGE)
    assert not whole_periods(k[:40], 2) and whole_periods(k, len(STAGE))
    seg, est = _segment(k, t)
    assert seg.period == len(STAGE)
    assert est.size >= len(dur) - 3
    assert np.median(np.abs(est - np.median(dur)) / np.median(dur)) < 0.05


def test_a_micro_batch_plan_and_its_revert_keep_whole_iterations():
    """One micro-batch makes the per-micro-batch receive an op of each iteration; when the plan
    is reverted it recurs eight times an iteration with about a period's calls between: the
    other anchors, missing from those gaps, say they are no iterations."""
    one = np.array([1, 2, 0], dtype=np.int64)
    ks, ts, t0 = [], [], 0.0
    for i, pattern in enumerate([STAGE, one, STAGE]):
        k, t, _ = _stream(20 + i, iters=100, pattern=pattern, t0=t0)
        ks.append(k)
        ts.append(t)
        t0 = t[-1] / 1e9 + 0.1
    seg, est = _segment(np.concatenate(ks), np.concatenate(ts))
    assert seg.period == len(STAGE)
    assert est.min() > 0.05  # the iterations are ~0.1 s; a micro-batch piece would be ~0.01 s
    assert est.size >= 280
