"""Bearer-token access control: who is calling and whether their role suffices.

``require(role)`` is the one dependency every /v1 route takes; it answers 401 with no (or an
unknown, expired or revoked) token and 403 with a token whose role is too weak. The OpenAPI
builder reads the role back from the dependency (``ROLE_ATTR``), so the documented role of a
route is the enforced one.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from services.api.errors import Forbidden, Unauthorized
from services.api.middleware import client_of
from services.api.tokens import (
    Principal,
    Role,
    at_least,
    display_prefix,
    hash_token,
    token_key,
    usable,
)
from services.common.db import repository as repo
from services.common.settings import Settings

log = logging.getLogger(__name__)
ROLE_ATTR = "greyhound_role"
_TOUCH_EVERY = timedelta(minutes=1)
bearer = HTTPBearer(auto_error=False, scheme_name="token",
                    description="`Authorization: Bearer gh_...` from `greyhound token create`")


async def _principal(request: Request, creds: HTTPAuthorizationCredentials | None) -> Principal:
    settings: Settings = request.app.state.settings
    if creds is None or not creds.credentials:
        anonymous = request.app.state.api_settings.api_anonymous_role
        if anonymous is not None:
            return Principal(name="anonymous", role=anonymous, token_id=None)
        raise Unauthorized("this route needs a bearer token (greyhound token create)")
    digest = hash_token(creds.credentials, token_key(settings))
    now = datetime.now(UTC)
    # a unit of its own: the token was used even when the request then fails
    async with request.app.state.work.unit() as uow:
        token = await repo.token_by_hash(uow.session, digest)
        if token is None or not usable(token.expires_at, token.revoked_at, now):
            _failed_login(request, creds.credentials, "unknown" if token is None else
                          f"expired or revoked ({token.name})")
            raise Unauthorized("unknown, expired or revoked token")
        if token.last_used_at is None or now - token.last_used_at > _TOUCH_EVERY:
            await repo.mark_token_used(uow.session, token.id, now)
    role: Role = token.role  # type: ignore[assignment]
    return Principal(name=token.name, role=role, token_id=token.id, job_id=token.job_id)


def _failed_login(request: Request, secret: str, why: str) -> None:
    """Log a failed authentication (who sent it, on which route, the token's first characters:
    enough to tell one caller's mistake from many guesses) and charge the client's failed-login
    bucket (services.api.middleware), past which its requests with a token get a 429."""
    client = client_of(request.scope)
    buckets = request.scope.get("state", {}).get("auth_failures")
    if buckets is not None:
        buckets.take(client)
    log.warning("failed login from %s on %s %s: %s token %r", client, request.method,
                request.url.path, why, display_prefix(secret)[:10])


def require(role: Role) -> Callable[..., Awaitable[Principal]]:
    async def check(request: Request,
                    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
                    ) -> Principal:
        who = await _principal(request, creds)
        if not at_least(who.role, role):
            raise Forbidden(f"this needs the {role} role; {who.name!r} is {who.role}")
        return who

    setattr(check, ROLE_ATTR, role)
    return check


def require_own_job() -> Callable[..., Awaitable[Principal]]:
    """A job's own routes (``/v1/jobs/{job_id}/...``): the job role or stronger, and a job token
    only for the job it names (403 on any other; a job token made before tokens named their job
    acts for none)."""
    async def check(request: Request, job_id: str,
                    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
                    ) -> Principal:
        who = await require("job")(request, creds)
        if not who.acts_for(job_id):
            mine = f"job {who.job_id!r}" if who.job_id else "no job (make one with --job)"
            raise Forbidden(f"{who.name!r} is a job token for {mine}, not for job {job_id!r}")
        return who

    setattr(check, ROLE_ATTR, "job")
    return check


Viewer = Annotated[Principal, Depends(require("viewer"))]
OwnJob = Annotated[Principal, Depends(require_own_job())]
Operator = Annotated[Principal, Depends(require("operator"))]
Admin = Annotated[Principal, Depends(require("admin"))]
