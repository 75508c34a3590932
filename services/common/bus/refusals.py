"""What the bus refused this connection: permission refusals as errors, never as timeouts.

NATS refuses a publish or a subscription that the user's permissions do not grant without
failing the call: it sends ``-ERR 'Permissions Violation for Publish to "<subject>"'`` and drops
the message, so a request (every JetStream API call and every JetStream publish is one) simply
gets no answer and times out. A timeout is transient (services.common.bus.errors), and a handler
whose request was refused used to be retried as if the bus were slow, for ever, holding up every
message behind it. So each connection (services.common.bus.client.connect) keeps the refusals
the server reported (``Refusals``), and a request that times out on a subject the server refused
meanwhile raises ``PermissionDenied``: a PermanentError that names the user, the subject and the
missing grant. The start-up check (services.common.bus.preflight) uses the same ledger.

The client lowercases the server's error text, so subjects are compared without case.
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from services.common.bus.errors import PermanentError

Action = Literal["publish", "subscribe"]

_VIOLATION = re.compile(r'permissions violation for (publish|subscription) to "([^"]+)"',
                        re.IGNORECASE)
HOW_TO_GRANT = ("the server's bus permissions lack this grant: regenerate them from the services' "
                "grants (the embedded NATS does so on start; a production server's config with "
                "python -m services.common.bus.server_config), see docs/security.md")


@dataclass(frozen=True, slots=True)
class Refusal:
    action: Action
    subject: str  # lowercased, as the client reports it
    at: float  # time.monotonic() when it was reported

    def covers(self, subject: str) -> bool:
        return self.subject == subject.lower()


def parse(text: str) -> tuple[Action, str] | None:
    """(action, subject) of a permissions-violation error text, or None for any other text."""
    m = _VIOLATION.search(text)
    if m is None:
        return None
    return ("publish" if m.group(1).lower() == "publish" else "subscribe"), m.group(2).lower()


class Refusals:
    """The newest refusal per (action, subject) of one connection, for a bounded number of
    subjects (the oldest forgotten first)."""

    def __init__(self, limit: int = 1000) -> None:
        self._limit = limit
        self._latest: OrderedDict[tuple[Action, str], Refusal] = OrderedDict()

    def record(self, text: str) -> Refusal | None:
        """Note the refusal ``text`` reports; None when it reports none."""
        found = parse(text)
        if found is None:
            return None
        refusal = Refusal(found[0], found[1], time.monotonic())
        self._latest[found] = refusal
        self._latest.move_to_end(found)
        while len(self._latest) > self._limit:
            self._latest.popitem(last=False)
        return refusal

    def since(self, t: float, subject: str, action: Action = "publish") -> Refusal | None:
        """The refusal of ``subject`` reported at or after ``t`` (monotonic), if any."""
        r = self._latest.get((action, subject.lower()))
        return r if r is not None and r.at >= t else None

    def any_since(self, t: float, prefix: str, action: Action = "publish") -> Refusal | None:
        """The newest refusal since ``t`` of a subject starting with ``prefix``."""
        p = prefix.lower()
        for (a, subject), r in reversed(self._latest.items()):
            if r.at < t:
                break
            if a == action and subject.startswith(p):
                return r
        return None


class PermissionDenied(PermanentError):
    """The bus refused this user something its code needs: no retry can fix it, only a grant."""

    def __init__(self, refusal: Refusal, user: str | None, doing: str = "") -> None:
        who = f"bus user {user!r}" if user else "a connection without a bus user"
        what = f" ({doing})" if doing else ""
        verb = "publish to" if refusal.action == "publish" else "subscribe to"
        super().__init__(f"the server refused {who} to {verb} {refusal.subject!r}{what}; "
                         f"{HOW_TO_GRANT}")
        self.refusal = refusal
        self.user = user
