"""The PyTorch integration on CPU: 4 gloo processes, gradients and iteration times under S2.

Needs PyTorch (``pip install -e '.[torch]'``, pinned to a CPU build); skipped when it is absent.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e '.[torch]')")

from tests.integrations.gloo import run_ranks

WORLD = 4


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    return run_ranks("tests.integrations.torch_worker", WORLD, tmp_path_factory.mktemp("gloo"),
                     timeout_s=150)


def test_uneven_allocation_gives_the_even_allocations_gradients(gloo_run: list[dict[str, object]]) -> None:
    r0 = gloo_run[0]
    assert float(r0["grad_norm"]) > 1e-3  # a real gradient, not zeros compared with zeros
    assert float(r0["max_diff_uneven_vs_even"]) < 1e-6
    assert float(r0["max_diff_even_vs_full_batch"]) < 1e-6


def test_rebalanced_iterations_beat_the_slowed_ones(gloo_run: list[dict[str, object]]) -> None:
    r0 = gloo_run[0]
    healthy, slowed, rebalanced = (float(r0[k]) for k in ("healthy_s", "slowed_s", "rebalanced_s"))
    profile = r0["profile_s"]
    assert isinstance(profile, list)
    print(f"\ngloo, 4 ranks, M=16, 60 ms per micro-batch, rank 1 at 1.5x: healthy {healthy:.3f} s, "
          f"slowed {slowed:.3f} s, re-balanced {r0['counts']} {rebalanced:.3f} s "
          f"(profile {[round(float(t), 4) for t in profile]} s per micro-batch)")
    # Sleeps alone give 0.24 / 0.36 / 0.30 s: the plan wins back half of the slowdown.
    assert slowed > 1.2 * healthy
    assert rebalanced < 0.92 * slowed
    counts = r0["counts"]
    assert isinstance(counts, list) and counts[1] == min(counts) and sum(counts) == 16
    # Every rank switched to the same plan, once.
    assert all(r["rank_counts"] == counts for r in gloo_run)
    assert all(r["rank_applied_versions"] == [2] for r in gloo_run)
