"""Every kind an incident can have, gathered from the cores that name them.

An incident opens as ``slowdown`` (or ``hang``) when the tracker detects it; the analyzer's
localisation (greyhound.core.slow_localization) or the validator's verdict
(greyhound.core.verdict) renames a slowdown compute, communication or mixed, and the hang
diagnosis (greyhound.core.hang_diagnosis) names a hang's cause. A filter on kinds is checked
against this list, so a typo is an error rather than an empty answer.
"""

from __future__ import annotations

from typing import get_args

from greyhound.core.hang_diagnosis import HangKind
from greyhound.core.slow_localization import LocalizedKind
from greyhound.core.verdict import VerdictKind

# "none" (profiling found nothing) and "transient" (the checks found nothing) never rename one.
_NOT_KINDS = frozenset({"none", "transient"})
KINDS: tuple[str, ...] = tuple(dict.fromkeys(
    ["slowdown", *(k for k in (*get_args(LocalizedKind), *get_args(VerdictKind))
                   if k not in _NOT_KINDS), "hang", *get_args(HangKind)]))


def is_hang(kind: str) -> bool:
    return kind.startswith("hang")


def matching(pattern: str) -> tuple[str, ...]:
    """The kinds a filter names: one kind, or every kind starting with what precedes a
    trailing ``*`` (``hang*``)."""
    if pattern.endswith("*"):
        prefix = pattern[:-1]
        return tuple(k for k in KINDS if k.startswith(prefix))
    return (pattern,) if pattern in KINDS else ()
