"""Job and agent ids: what is accepted, what is refused, and ids made from free text."""

from __future__ import annotations

import re

import pytest

from greyhound.ids import TOKEN_PATTERN, check_token, slug


@pytest.mark.parametrize("good", ["job-1", "A_b", "x" * 128])
def test_valid_ids_pass_unchanged(good: str) -> None:
    assert check_token(good, "job id") == good


@pytest.mark.parametrize("bad", ["", "a.b", "a b", "a*", "gh>", "x" * 129, "ré"])
def test_invalid_ids_name_the_id_and_the_rule(bad: str) -> None:
    with pytest.raises(ValueError, match=r"job id .* must match \[A-Za-z0-9_-\]\{1,128\}"):
        check_token(bad, "job id")


def test_slug_is_a_valid_id_piece() -> None:
    assert slug("Rank 3 / node.7 (slow)", 40) == "Rank-3-node-7-slow"
    assert slug("...", 10) == ""
    made = slug("résumé of a very long scenario name " * 4, 40)
    assert len(made) <= 40 and re.match(TOKEN_PATTERN, made)
