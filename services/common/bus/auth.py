"""Who a process is on the bus: its NATS user and password, its TLS, and the names both follow.

Every service connects as the user named after it (services.common.bus.grants); an agent as
``agent-<id>``, one user per node, because its permissions name its agent id
(services.common.bus.permissions).
Each user gets its own reply-inbox prefix, ``_GH_INBOX.<user>``, so that the server can let a
user subscribe to its own replies only: nobody reads the answers meant for another.
"""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from greyhound.ids import check_token, slug

AGENT_USER_PREFIX = "agent-"
INBOX_ROOT = "_GH_INBOX"


class BusAuthError(RuntimeError):
    """The bus refused this process's credentials, or its settings for them are incomplete."""


@dataclass(frozen=True, slots=True)
class Credentials:
    user: str
    password: str = field(repr=False)

    @property
    def inbox_prefix(self) -> str:
        return inbox_prefix(self.user)


def default_agent_id() -> str:
    """The agent id when none is given: this host's short name (its user is agent-<that>)."""
    return slug(socket.gethostname().split(".")[0], 100) or "agent"


def agent_user(agent_id: str) -> str:
    """The bus user of the agent ``agent_id``."""
    return f"{AGENT_USER_PREFIX}{check_token(agent_id, 'agent id')}"


def agent_of_user(user: str) -> str | None:
    """The agent id a user is bound to, or None for a service's user."""
    if not user.startswith(AGENT_USER_PREFIX):
        return None
    rest = user.removeprefix(AGENT_USER_PREFIX)
    try:
        return check_token(rest, "agent id")
    except ValueError:
        return None


def inbox_prefix(user: str) -> str:
    return f"{INBOX_ROOT}.{check_token(user, 'bus user')}"


def tls_context(ca: Path | None, cert: Path | None, key: Path | None) -> ssl.SSLContext | None:
    """A client TLS context that trusts ``ca`` (else the system's roots) and presents
    ``cert``/``key`` when the server asks for client certificates; None when nothing is set
    (a ``tls://`` URL then uses the system's roots)."""
    if ca is None and cert is None and key is None:
        return None
    if (cert is None) != (key is None):
        raise BusAuthError("a NATS client certificate needs both GREYHOUND_NATS_TLS_CERT and "
                           "GREYHOUND_NATS_TLS_KEY")
    ctx = ssl.create_default_context(cafile=str(ca) if ca is not None else None)
    if cert is not None and key is not None:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


