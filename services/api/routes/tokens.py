"""API tokens (admin), who the caller is (any role), and the audit log (admin)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query, Response

from services.api.auth import Admin, Viewer
from services.api.deps import Session, SettingsDep, problems
from services.api.errors import Conflict, NotFound
from services.api.schemas import AuditOut, AuditTarget, Me, TokenCreated, TokenIn, TokenOut
from services.api.tokens import display_prefix, hash_token, new_token, token_key
from services.common.db import repository as repo

router = APIRouter(tags=["access"])


@router.get("/v1/me", response_model=Me, summary="Who the token belongs to and its role")
async def me(who: Viewer) -> Me:
    return Me(name=who.name, role=who.role, token_id=who.token_id, job_id=who.job_id)


@router.get("/v1/tokens", response_model=list[TokenOut], summary="Tokens (never their secrets)",
            responses=problems(422))
async def list_tokens(session: Session, _: Admin,
                      include_revoked: bool = False) -> list[TokenOut]:
    rows = await repo.list_tokens(session, include_revoked=include_revoked)
    return [TokenOut.model_validate(t) for t in rows]


@router.post("/v1/tokens", response_model=TokenCreated, status_code=201,
             summary="Create a token; the secret is returned this once",
             responses=problems(422))
async def create_token(body: TokenIn, session: Session, settings: SettingsDep,
                       who: Admin) -> TokenCreated:
    secret = new_token()
    expires = (datetime.now(UTC) + timedelta(days=body.expires_in_days)
               if body.expires_in_days else None)
    token = await repo.create_token(session, name=body.name, role=body.role,
                                    token_hash=hash_token(secret, token_key(settings)),
                                    prefix=display_prefix(secret), created_by=who.name,
                                    expires_at=expires, job_id=body.job_id)
    await repo.audit(session, actor=who.name, token_id=who.token_id, action="token.create",
                     target_type="token", target_id=token.id,
                     detail={"name": token.name, "role": token.role, "job_id": token.job_id})
    return TokenCreated(**TokenOut.model_validate(token).model_dump(), token=secret)


@router.delete("/v1/tokens/{token_id}", status_code=204, response_class=Response,
               summary="Revoke a token", description="409 when it is already revoked.",
               responses=problems(404, 409))
async def revoke_token(token_id: str, session: Session, who: Admin) -> Response:
    token = await repo.get_token(session, token_id)
    if token is None:
        raise NotFound(f"token {token_id!r} not found")
    if token.revoked_at is not None:
        raise Conflict(f"token {token_id} is already revoked")
    token.revoked_at = datetime.now(UTC)
    await repo.audit(session, actor=who.name, token_id=who.token_id, action="token.revoke",
                     target_type="token", target_id=token.id, detail={"name": token.name})
    return Response(status_code=204)


@router.get("/v1/audit", response_model=list[AuditOut],
            summary="Every state-changing call, newest first", responses=problems(422))
async def audit_log(session: Session, _: Admin,
                    target_type: AuditTarget | None = None,
                    target_id: Annotated[str | None, Query(max_length=128)] = None,
                    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0) -> list[AuditOut]:
    rows = await repo.list_audit(session, limit=limit, offset=offset, target_type=target_type,
                                 target_id=target_id)
    return [AuditOut.model_validate(a) for a in rows]
