"""Job ids and agent ids: one rule for what they may hold.

A job id names the hook's ring directory and is a token of every bus subject about the job; an
agent id ends the subjects of its telemetry and control. A dot, a space or a wildcard would
split or widen a subject, so both are short runs of letters, digits, ``_`` and ``-``.
"""

from __future__ import annotations

import re

TOKEN_CHARS = "A-Za-z0-9_-"
MAX_TOKEN = 128
TOKEN_PATTERN = rf"^[{TOKEN_CHARS}]{{1,{MAX_TOKEN}}}$"
_TOKEN = re.compile(TOKEN_PATTERN)
_OTHER = re.compile(rf"[^{TOKEN_CHARS}]+")


def check_token(value: str, what: str) -> str:
    """``value`` if it is a valid id, else a ValueError that says which id and the rule."""
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} must match [{TOKEN_CHARS}]{{1,{MAX_TOKEN}}} "
                         "(it is a NATS subject token)")
    return value


def slug(text: str, max_len: int) -> str:
    """``text`` made a valid id piece: runs of other characters become one ``-``; may be empty."""
    return _OTHER.sub("-", text).strip("-")[:max_len]
