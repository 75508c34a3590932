"""One error hierarchy for the REST API, answered as RFC 9457 ``application/problem+json``.

Routes raise an ``ApiError`` subclass; a single handler turns it (and FastAPI's own validation
and routing errors) into a problem document, so every error a client sees has one shape and the
OpenAPI declares it once (see ``openapi.py``).

A dependency that went away (the database restarting, a connection cut) is the server's
temporary condition, not a bug: any request that fails on it answers 503 with ``Retry-After``,
classified by the same rule as the bus consumers (services.common.bus.errors), never a 500.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import asyncpg
import sqlalchemy.exc as sa
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.bus.errors import classify, describe
from services.common.redact import redact_text

log = logging.getLogger(__name__)

PROBLEM_JSON = "application/problem+json"
RETRY_AFTER_S = 5
# What a database (or another dependency) that is away raises; classify() decides whether it is.
INFRASTRUCTURE_ERRORS: tuple[type[Exception], ...] = (
    sa.SQLAlchemyError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError)


class Problem(BaseModel):
    """RFC 9457 problem details."""

    type: str = Field(default="about:blank", examples=["urn:greyhound:problem:conflict"])
    title: str = Field(examples=["Conflict"])
    status: int = Field(examples=[409])
    detail: str = Field(default="", examples=["incident 3f2a... is already resolved"])
    instance: str | None = Field(default=None, examples=["/v1/incidents/3f2a.../close"])
    errors: list[dict[str, Any]] | None = Field(
        default=None, description="what failed validation (422 only)")


class ApiError(Exception):
    status: ClassVar[int] = 500
    title: ClassVar[str] = "Internal Server Error"
    slug: ClassVar[str] = "internal"

    def __init__(self, detail: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.headers = headers or {}


class Unauthorized(ApiError):
    status, title, slug = 401, "Unauthorized", "unauthorized"

    def __init__(self, detail: str) -> None:
        super().__init__(detail, headers={"WWW-Authenticate": 'Bearer realm="greyhound"'})


class Forbidden(ApiError):
    status, title, slug = 403, "Forbidden", "forbidden"


class NotFound(ApiError):
    status, title, slug = 404, "Not Found", "not-found"


class Conflict(ApiError):
    status, title, slug = 409, "Conflict", "conflict"


class Invalid(ApiError):
    status, title, slug = 422, "Unprocessable Content", "invalid"


class Unavailable(ApiError):
    status, title, slug = 503, "Service Unavailable", "unavailable"


def problem_response(status: int, title: str, detail: str, *, slug: str, instance: str | None,
                     errors: list[dict[str, Any]] | None = None,
                     headers: dict[str, str] | None = None) -> JSONResponse:
    body = Problem(type=f"urn:greyhound:problem:{slug}", title=title, status=status,
                   detail=detail, instance=instance, errors=errors)
    return JSONResponse(body.model_dump(exclude_none=True), status_code=status,
                        media_type=PROBLEM_JSON, headers=headers)


def _jsonable_errors(exc: RequestValidationError) -> list[dict[str, Any]]:
    """Validation errors without their ``ctx``/``input`` (which may hold non-JSON objects)."""
    return [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")),
             "type": str(e.get("type", ""))} for e in exc.errors()[:20]]


def install_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return problem_response(exc.status, exc.title, exc.detail, slug=exc.slug,
                                instance=request.url.path, headers=exc.headers)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = _jsonable_errors(exc)
        first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
        where = ".".join(str(p) for p in first["loc"])
        detail = f"{where}: {first['msg']}"
        sent = request.headers.get("content-type", "")
        if first["loc"][:1] == ["body"] and "json" not in sent.lower():
            # curl -d without -H sends a form, which reads as "not a dictionary"
            detail = (f"the body must be JSON, sent with Content-Type: application/json (this "
                      f"request's is {sent or 'not set'}); {detail}")
        return problem_response(422, Invalid.title, detail, slug=Invalid.slug,
                                instance=request.url.path, errors=errors)

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        title = {404: "Not Found", 405: "Method Not Allowed"}.get(exc.status_code, "Error")
        return problem_response(exc.status_code, title, str(exc.detail), slug="http",
                                instance=request.url.path, headers=dict(exc.headers or {}))

    async def on_infrastructure(request: Request, exc: Exception) -> JSONResponse:
        if classify(exc) == "transient":
            log.warning("%s %s: a dependency is unavailable: %s", request.method,
                        request.url.path, redact_text(describe(exc))[:500])
            return problem_response(
                503, Unavailable.title, "a dependency (the database) is unavailable; retry later",
                slug=Unavailable.slug, instance=request.url.path,
                headers={"Retry-After": str(RETRY_AFTER_S)})
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return problem_response(500, ApiError.title, "internal error", slug=ApiError.slug,
                                instance=request.url.path)

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    for kind in INFRASTRUCTURE_ERRORS:
        app.add_exception_handler(kind, on_infrastructure)


def storable_text(value: str) -> str | None:
    """Why a string cannot go to Postgres (a NUL, or a lone surrogate that is not UTF-8), or
    None when it can: such input is the client's error (422), not a server failure."""
    if "\x00" in value:
        return "contains a NUL character"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid UTF-8"
    return None


async def reject_unstorable(request: Request) -> None:
    """Every route: path and query values must be storable text."""
    for where, items in (("path", request.path_params.items()),
                         ("query", request.query_params.multi_items())):
        for name, value in items:
            why = storable_text(str(value))
            if why is not None:
                raise Invalid(f"{where} parameter {name} {why}")
