"""API tokens: made, hashed and ranked here (shared by the REST API and ``greyhound token``).

A token is 32 random bytes (256 bits) from the OS, printed once as ``gh_<base64url>``. The
database keeps HMAC-SHA256(key, token) only, keyed by ``GREYHOUND_TOKEN_KEY`` (a pepper kept out of
the database, so a stolen dump cannot even test a guess, nor can a database writer add a token
of its own; the embedded mode keeps one per data directory: services.common.data_keys). A fast hash is
right here and bcrypt/argon2 are not: those are slow on purpose to protect low-entropy human
passwords from offline guessing, which a 256-bit random secret already makes hopeless, while a
slow hash would cost tens of milliseconds of CPU on every API request (each one verifies its
token) and hand anyone who sends garbage tokens an easy denial of service.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal

from greyhound.ids import check_token
from services.common.data_keys import LEGACY_TOKEN_KEY
from services.common.settings import Settings

# ``job``: a training job's own token: it reads what a viewer reads, declares its layout and
# reports what it did with its plans, for its own job only (the token names it), and decides
# nothing.
Role = Literal["viewer", "job", "operator", "admin"]
ROLES: tuple[Role, ...] = ("viewer", "job", "operator", "admin")
_RANK = {r: i for i, r in enumerate(ROLES)}
TOKEN_PREFIX = "gh_"
_DEFAULT_KEY = LEGACY_TOKEN_KEY.encode()  # only where no key is set (docs/security.md)
_DURATION = re.compile(r"^(\d+)([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def at_least(have: str, need: Role) -> bool:
    """viewer < job < operator < admin; an unknown role grants nothing."""
    return have in _RANK and _RANK[have] >= _RANK[need]


def check_scope(role: str, job_id: str | None) -> None:
    """A job token names its job, and only a job token does: ValueError otherwise. A job token
    good for every job could declare another job's layout (S2 plans are built from it and
    applied without an operator) and report another job's plans applied or failed."""
    if role == "job" and job_id is None:
        raise ValueError("a job token names its job (--job <id>): it acts for that job only")
    if role != "job" and job_id is not None:
        raise ValueError(f"only a job token names a job; a {role} token acts on every job")
    if job_id is not None:
        check_token(job_id, "job id")


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


class MissingTokenKey(ValueError):
    """A database the operator configured, and no key to hash its tokens with."""


def token_key(settings: Settings) -> bytes | None:
    """The key API tokens are hashed with: ``GREYHOUND_TOKEN_KEY``; None (the public default
    key) only on the data directory's embedded Postgres, which makes its own key anyway
    (services.common.data_keys) and keeps the default only for tokens made before it did. A
    configured database without a key raises MissingTokenKey: a hash keyed by a public key
    lets anyone who reads the table test a guess, or add a token of their own."""
    if settings.token_key is not None:
        return settings.token_key.get_secret_value().encode()
    if settings.database_url is not None:
        raise MissingTokenKey(
            "GREYHOUND_TOKEN_KEY is not set: on a database you configured "
            "(GREYHOUND_DATABASE_URL) API tokens are hashed with a key of yours; set it (a "
            "random string, the same for every API process and `greyhound token`)")
    return None


def hash_token(token: str, key: bytes | None) -> str:
    return hmac.new(key or _DEFAULT_KEY, token.encode(), hashlib.sha256).hexdigest()


def display_prefix(token: str) -> str:
    """Enough of the token to tell tokens apart in a listing, far too little to guess the rest."""
    return token[:10]


def parse_duration(text: str) -> timedelta:
    """``30d``, ``12h``, ``90m``, ``2w``: how long a token lives."""
    m = _DURATION.match(text.strip())
    if not m or int(m.group(1)) <= 0:
        raise ValueError(f"expiry must look like 30d, 12h, 90m or 2w, got {text!r}")
    return timedelta(seconds=int(m.group(1)) * _UNIT_S[m.group(2)])


@dataclass(frozen=True)
class Principal:
    """Who is calling: the token's name (what the audit log records) and its role."""

    name: str
    role: Role
    token_id: str | None
    job_id: str | None = None  # a job token's job

    def acts_for(self, job_id: str) -> bool:
        """May call ``job_id``'s own routes (declare its layout, report its plans): a job token
        for its own job only; operators and admins for any job, as their role always allowed
        (fixing a job whose reporter died is theirs to do, and they approve its plans anyway)."""
        if self.role == "job":
            return self.job_id == job_id
        return at_least(self.role, "job")


def usable(expires_at: datetime | None, revoked_at: datetime | None,
           now: datetime | None = None) -> bool:
    now = now or datetime.now(UTC)
    return revoked_at is None and (expires_at is None or expires_at > now)
