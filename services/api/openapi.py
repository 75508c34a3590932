"""The OpenAPI document, completed from what the code enforces.

Each /v1 operation gets ``x-required-role`` (read from its ``require(role)`` dependency, so the
document cannot drift from the check), its 401 and 403 answers, every operation the 429 (and
every one with a body the 413) that the guards in services.api.middleware answer before any
route runs, and every error answer is declared as ``application/problem+json`` with the one
``Problem`` schema.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute

from services.api.auth import ROLE_ATTR
from services.api.errors import PROBLEM_JSON, Problem

DESCRIPTION = """\
Greyhound finds fail-slows (stragglers) and hangs in distributed training jobs and names the
GPU, link or rank behind them. This API is the on-call surface.

**Access.** Send `Authorization: Bearer <token>`. Tokens have a role, viewer < job < operator <
admin: reading needs viewer; a training job's own token (job) also declares its layout and reports
what it did with its plans; acknowledging or closing incidents and approving or rejecting plans
need operator; webhooks, tokens and the audit log need admin. No token: 401; a weaker role: 403. The
first admin token is made on the server with `greyhound token create --role admin`. `/healthz`,
`/readyz` and `/metrics` need no token. Every state-changing call is in the audit log.

**Errors** are `application/problem+json` (RFC 9457): `type`, `title`, `status`, `detail`.

**Cost.** Each incident carries `cost.gpu_hours_lost` = lost fraction x the job's GPUs x
duration / 3600: the lost fraction is 1 - before/after of the tracker's measured iteration time
(1 for a hang), the GPUs are the job's world size, and the duration runs from the estimated
onset (first slow iteration, or the start of the stall) to the resolution or now.

**Fleet.** `/v1/fleet` maps incidents to hardware across jobs and advises draining a GPU, node or
link with >= 3 incidents confirmed by validation within 7 days from >= 2 jobs (settings).
"""

TAGS = [
    {"name": "incidents", "description": "Fail-slows and hangs, their evidence and cost"},
    {"name": "jobs", "description": "Jobs, their ranks and recent iteration times"},
    {"name": "plans", "description": "Mitigation plans and their approval"},
    {"name": "fleet", "description": "Hardware with repeated incidents across jobs"},
    {"name": "webhooks", "description": "Signed notifications to on-call (admin)"},
    {"name": "access", "description": "Tokens, the caller, and the audit log"},
    {"name": "operations", "description": "Probes and metrics"},
]


def role_of(dependant: Dependant) -> str | None:
    for dep in dependant.dependencies:
        role = getattr(dep.call, ROLE_ATTR, None)
        if isinstance(role, str):
            return role
        found = role_of(dep)
        if found is not None:
            return found
    return None


def _problem(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}}}


def install_openapi(app: FastAPI, routers: Sequence[APIRouter]) -> None:
    def build() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=DESCRIPTION,
                             routes=app.routes, tags=TAGS)
        roles = {}
        for route in (r for router in routers for r in router.routes):
            if isinstance(route, APIRoute):
                role = role_of(route.dependant)
                for method in route.methods or ():
                    roles[(route.path_format, method.lower())] = role
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components["Problem"] = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
        for path, item in schema.get("paths", {}).items():
            for method, op in item.items():
                responses = op.setdefault("responses", {})
                role = roles.get((path, method))
                if "requestBody" in op:
                    responses.setdefault("400", _problem("the body is not JSON (or not UTF-8)"))
                    responses.setdefault("413", _problem("the body is over the API's limit"))
                # any route, before its own checks (services.api.middleware)
                responses.setdefault("429", _problem(
                    "too many requests, or failed logins, from this address; Retry-After says "
                    "when to try again"))
                if role is not None:
                    op["x-required-role"] = role
                    responses.setdefault("401", _problem("no valid token"))
                    responses.setdefault("403", _problem(f"role weaker than {role}"))
                for code, resp in list(responses.items()):
                    if code.isdigit() and int(code) >= 400 and path != "/readyz":
                        responses[code] = _problem(resp.get("description", "error"))
        for unused in ("HTTPValidationError", "ValidationError"):
            components.pop(unused, None)
        app.openapi_schema = schema
        return schema

    app.openapi = build  # type: ignore[method-assign]
