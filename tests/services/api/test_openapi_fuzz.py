"""The OpenAPI document fuzzed with schemathesis against a served API (real Postgres and NATS):
no 500s, and every answer matches its declared status codes, content types and schemas.

Bounded: a fixed number of derandomised examples per operation, so the run takes about the
same time each time (well under a minute on two cores)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import checks
from schemathesis.generation import GenerationMode

from services.common.runtime import start_service
from tests.conftest import Bus
from tests.services.api.conftest import Api, api_settings
from tests.services.api.live import serve_api
from tests.services.notifier.receiver import free_port

EXAMPLES = 20
CHECKS = [checks.not_a_server_error, checks.status_code_conformance,
          checks.content_type_conformance, checks.response_schema_conformance]
# Invalid input: never a 500, and the 4xx that comes back is declared, as problem+json.
NEGATIVE_CHECKS = [checks.not_a_server_error, checks.status_code_conformance,
                   checks.content_type_conformance]


@pytest.fixture(scope="module")
def served(bus: Bus, pg_url: str, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, str]]:
    """The API in a thread with its own event loop (schemathesis calls it synchronously),
    on the session's Postgres (its own database) and NATS; yields (base URL, admin token)."""
    import asyncpg

    tmp = tmp_path_factory.mktemp("fuzz")
    db = f"fuzz_{free_port()}"
    admin_url = pg_url.replace("postgresql+asyncpg://", "postgresql://", 1)
    base, _, query = pg_url.partition("?")
    db_url = f"{base.rsplit('/', 1)[0]}/{db}" + (f"?{query}" if query else "")
    port = free_port()
    ready = threading.Event()
    stop = threading.Event()
    box: dict[str, str] = {}

    async def main() -> None:
        conn = await asyncpg.connect(admin_url)
        await conn.execute(f'CREATE DATABASE "{db}"')
        await conn.close()
        s = api_settings(bus.url, db_url, Path(tmp))
        ctx = await start_service("api", s, backends=bus.backends("api", db_url))
        try:
            box["token"] = await Api(ctx, None, None).token("admin", "fuzzer")
            async with serve_api(ctx, port) as url:
                box["url"] = url
                ready.set()
                while not stop.is_set():
                    await asyncio.sleep(0.1)
        finally:
            await ctx.close()
            conn = await asyncpg.connect(admin_url)
            with contextlib.suppress(Exception):
                await conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
            await conn.close()

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    assert ready.wait(60), "the API did not start"
    yield box["url"], box["token"]
    stop.set()
    thread.join(30)


def _fuzz(op: Any, mode: GenerationMode, examples: int, to_check: list[Any],
          headers: dict[str, str]) -> None:
    @given(case=op.as_strategy(mode))
    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case: Any) -> None:
        case.call_and_validate(headers=headers, checks=to_check, timeout=30)

    run()


def test_api_conforms_to_its_openapi(served: tuple[str, str]) -> None:
    """Each operation in turn (schemathesis's pytest plugin does not load under this pytest,
    so hypothesis drives each operation's strategy directly); every failure is reported."""
    url, token = served
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    headers = {"Authorization": f"Bearer {token}"}
    failures: list[str] = []
    operations = 0
    for result in schema.get_all_operations():
        op = result.ok()  # type: ignore[union-attr]
        operations += 1
        for mode, examples, to_check in (
                (GenerationMode.POSITIVE, EXAMPLES, CHECKS),
                (GenerationMode.NEGATIVE, EXAMPLES // 2, NEGATIVE_CHECKS)):
            try:
                _fuzz(op, mode, examples, to_check, headers)
            except (KeyboardInterrupt, SystemExit):
                raise
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE  # nothing to get wrong: no parameters
            except BaseException as exc:  # schemathesis raises exception groups
                failures.append(f"{op.method.upper()} {op.path} ({mode.value}): {exc}"[:2000])
    assert operations >= 26
    assert not failures, "\n\n".join(failures)
