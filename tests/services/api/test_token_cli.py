"""``greyhound token``: the first admin token of a fresh install, made on the command line,
works against the API; list shows it without the secret; revoke ends it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from services.api.app import create_app
from services.api.settings import ApiSettings
from services.api.tokens import MissingTokenKey
from services.common.db.session import make_engine, make_sessionmaker
from tests.services.api.conftest import TOKEN_KEY, api_settings

# What the command loaded, printed after it ran (the bus client, the services, Alembic).
_LOADED = ("import sys, runpy; sys.argv = ['greyhound', 'token', *sys.argv[1:]]\n"
           "try:\n    runpy.run_module('stack.cli', run_name='__main__')\n"
           "finally:\n    print('loaded:', sorted(m for m in ('nats', 'alembic', "
           "'services.registry', 'services.common.runtime') if m in sys.modules), "
           "file=sys.stderr)")


def _cli(db_url: str, tmp: Path, *args: str, nats: bool = True,
         key: str | None = TOKEN_KEY) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GREYHOUND_NATS_URL", "GREYHOUND_TOKEN_KEY")}
    env |= {"GREYHOUND_DATABASE_URL": db_url, "GREYHOUND_DATA_DIR": str(tmp / "data")}
    if key is not None:
        env["GREYHOUND_TOKEN_KEY"] = key
    if nats:
        env["GREYHOUND_NATS_URL"] = "nats://127.0.0.1:1"
    return subprocess.run([sys.executable, "-c", _LOADED, *args], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


async def test_first_admin_token_from_the_cli(fresh_db_url: str, tmp_path: Path) -> None:
    made = _cli(fresh_db_url, tmp_path, "create", "--role", "admin", "--name", "first-admin",
                "--expires", "30d")
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip()
    assert secret.startswith("gh_") and len(secret) > 40 and "shown once" in made.stderr
    listed = _cli(fresh_db_url, tmp_path, "list")
    assert "first-admin" in listed.stdout and "admin" in listed.stdout
    assert secret not in listed.stdout and secret[:10] in listed.stdout

    engine = make_engine(fresh_db_url)
    app = create_app(make_sessionmaker(engine), settings=api_settings(
        "nats://127.0.0.1:1", fresh_db_url, tmp_path), api=ApiSettings())
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://a") as c:
            auth = {"Authorization": f"Bearer {secret}"}
            me = (await c.get("/v1/me", headers=auth)).json()
            assert me["name"] == "first-admin" and me["role"] == "admin"
            audit = (await c.get("/v1/audit", headers=auth)).json()
            assert audit[0]["action"] == "token.create" and audit[0]["actor"].startswith("cli")
            revoked = _cli(fresh_db_url, tmp_path, "revoke", "first-admin")
            assert revoked.returncode == 0 and "revoked" in revoked.stdout
            assert (await c.get("/v1/me", headers=auth)).status_code == 401
    finally:
        await engine.dispose()
    again = _cli(fresh_db_url, tmp_path, "revoke", "first-admin")
    assert again.returncode == 1 and "no live token" in again.stderr
    bad = _cli(fresh_db_url, tmp_path, "create", "--role", "viewer", "--expires", "soon")
    assert bad.returncode == 2 and "expiry must look like" in bad.stderr
    unscoped = _cli(fresh_db_url, tmp_path, "create", "--role", "job")
    assert unscoped.returncode == 2 and "--job" in unscoped.stderr
    scoped = _cli(fresh_db_url, tmp_path, "create", "--role", "job", "--job", "train-7")
    assert scoped.returncode == 0 and "for job train-7" in scoped.stderr, scoped.stderr
    assert "(job train-7)" in _cli(fresh_db_url, tmp_path, "list").stdout


def test_token_create_needs_the_database_only(fresh_db_url: str, tmp_path: Path) -> None:
    """No NATS configured: the command must not start the data directory's embedded NATS (it
    did, which made it take seconds while an operator waited to approve a plan), and once the
    schema is there it loads neither the bus client nor Alembic."""
    first = _cli(fresh_db_url, tmp_path, "create", "--role", "operator", nats=False)
    assert first.returncode == 0, first.stderr
    assert "loaded: ['alembic']" in first.stderr  # a fresh database: the schema was made
    again = _cli(fresh_db_url, tmp_path, "create", "--role", "viewer", "--name", "v", nats=False)
    assert again.returncode == 0, again.stderr
    assert "loaded: []" in again.stderr
    assert not (tmp_path / "data" / "nats").exists()
    listed = _cli(fresh_db_url, tmp_path, "list", nats=False)
    assert "operator" in listed.stdout and " v " in listed.stdout


def test_a_configured_database_needs_a_token_key(fresh_db_url: str, tmp_path: Path) -> None:
    """Hashes keyed by the public default key would let anyone who reads the table test a
    guess or add a token: on a configured database, no key is an error, said at once."""
    keyless = _cli(fresh_db_url, tmp_path, "create", "--role", "admin", key=None)
    assert keyless.returncode == 2 and "GREYHOUND_TOKEN_KEY is not set" in keyless.stderr
    assert keyless.stdout == ""
    with pytest.raises(MissingTokenKey, match="GREYHOUND_TOKEN_KEY"):
        create_app(make_sessionmaker(make_engine(fresh_db_url)), settings=api_settings(
            "nats://127.0.0.1:1", fresh_db_url, tmp_path, token_key=None), api=ApiSettings())
