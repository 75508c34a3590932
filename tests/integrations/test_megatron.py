"""megatron-core from PyPI on CPU (gloo, 4 processes): S2 through its micro-batch calculator and
DDP gradient scaling, S3 through its parallel_state. What needs a GPU and how far this goes
without one is in tests/integrations/megatron_worker.py. Skipped without megatron-core
(``pip install -e '.[megatron]'``)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e '.[torch]')")
pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from tests.integrations.gloo import run_ranks

WORLD = 4
# About 60 CPU-seconds, most of it four processes importing megatron.core (10 s each on an idle
# core); the bounds leave ten times the minute that takes on 2 idle cores.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks("tests.integrations.megatron_worker", WORLD,
                     tmp_path_factory.mktemp("megatron"), timeout_s=600)


def _diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_s2_megatron_ddp_with_the_followers_weight_gives_the_full_batch_gradient(
        ranks: list[dict[str, Any]]) -> None:
    r0 = ranks[0]
    full = r0["full_batch"]
    assert max(abs(x) for x in full) > 1e-3  # a real gradient
    # Every rank holds the same reduced gradient.
    for r in ranks:
        assert _diff(r["uneven_weighted"], r0["uneven_weighted"]) == 0.0
    assert _diff(r0["even"], full) < 1e-6
    assert _diff(r0["uneven_weighted"], full) < 1e-6
    # Megatron's own 1 / dp weighting under uneven counts is wrong: the hook point matters.
    assert _diff(r0["uneven_megatron_default"], full) > 1e-3
    print(f"\nmegatron DDP, counts (1, 7, 3, 5): weighted vs full batch "
          f"{_diff(r0['uneven_weighted'], full):.2e}, Megatron's default 1/dp "
          f"{_diff(r0['uneven_megatron_default'], full):.2e}")


def test_s3_parallel_state_is_rebuilt_for_the_role_swap(ranks: list[dict[str, Any]]) -> None:
    # Layout (0, 2, 1, 3): rank 1 (stage 0, DP 1) on process 2, rank 2 (stage 1, DP 0) on 1.
    expect = {0: (0, 0, 1, [0, 2], [0, 1]), 1: (1, 0, 0, [1, 3], [0, 1]),
              2: (0, 1, 3, [0, 2], [2, 3]), 3: (1, 1, 2, [1, 3], [2, 3])}
    for p, r in enumerate(ranks):
        s3 = r["s3"]
        assert s3["before"] == {"stage": p // 2, "dp": p % 2}
        v = s3["swapped"]
        stage, dp, peer, dp_ranks, pp_ranks = expect[p]
        assert (v["stage"], v["dp"]) == (stage, dp) == tuple(v["role"])
        assert v["first"] == (stage == 0) and v["last"] == (stage == 1)
        assert v["next"] == v["prev"] == peer
        assert v["dp_ranks"] == dp_ranks and v["pp_ranks"] == pp_ranks
        assert v["dp_sum"] == v["dp_sum_gloo"] == sum(dp_ranks)
        assert v["received_from"] == (peer if stage == 1 else None)
        assert v["embedding"] is True
        assert v["old_groups_destroyed"] is True


def test_s3_a_rebuild_failing_on_one_process_leaves_parallel_state_as_it_was(
        ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        s3 = r["s3"]
        assert s3["after_failed"] == {k: v for k, v in s3["swapped"].items()
                                      if k not in ("role", "old_groups_destroyed")}
        (v1, ok1, _), (v2, ok2, why) = s3["outcomes"]
        assert (v1, ok1, v2, ok2) == (1, True, 2, False)
        assert "process 3" in why and "Megatron's groups" in why
