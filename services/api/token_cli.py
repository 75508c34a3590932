"""``greyhound token create|list|revoke``: tokens made on the server, straight in the database.

This is how a fresh install gets its first admin token (the REST routes for tokens need one):
the command reads the same settings as the services, migrates the schema if its tables are not
there yet, and prints the secret once. Every change is audited as ``cli:<os user>``.

It needs the database only: no NATS is started or reached, and neither the bus client nor
Alembic is loaded unless the schema must be made. An operator makes tokens while a plan waits
for approval, so the command must be quick (the embedded Postgres of the data directory is
reused when it runs).
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TextIO

import sqlalchemy.exc as sa

from services.api.tokens import (
    ROLES,
    check_scope,
    display_prefix,
    hash_token,
    new_token,
    parse_duration,
    token_key,
    usable,
)
from services.common.db import repository as repo
from services.common.db.session import make_engine, make_sessionmaker
from services.common.embedded import EmbeddedPostgres
from services.common.settings import Settings
from services.common.unit_of_work import Work

HELP = "API tokens (made and revoked in the database directly)"
# Postgres's codes for a table or a column that is not there: the schema is older than the code.
SCHEMA_MISSING = frozenset({"42P01", "42703"})


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    build_parser(sub.add_parser("token", help=HELP))


def build_parser(tok: argparse.ArgumentParser) -> argparse.ArgumentParser:
    tsub = tok.add_subparsers(dest="token_command", required=True)
    create = tsub.add_parser("create", help="make a token; its secret is printed once")
    create.add_argument("--role", required=True, choices=ROLES)
    create.add_argument("--name", default=None, help="who or what uses it (default: the role)")
    create.add_argument("--job", default=None, metavar="ID",
                        help="the job a job token acts for (required with --role job)")
    create.add_argument("--expires", default=None, metavar="D",
                        help="lifetime such as 90d, 12h, 2w (default: never)")
    tsub.add_parser("list", help="tokens that are not revoked")
    revoke = tsub.add_parser("revoke", help="revoke a token by id, id prefix or name")
    revoke.add_argument("token", help="id, id prefix (8+ characters) or name")
    return tok


def _actor() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):
        return "cli"


def _schema_missing(exc: sa.DBAPIError) -> bool:
    code = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
    return code in SCHEMA_MISSING


async def _run(settings: Settings, url: str, args: argparse.Namespace, out: TextIO) -> int:
    """The command, on the schema as it is; on a database without it (a fresh install), the
    schema is made first and the command runs again (nothing was written or printed)."""
    try:
        return await _command(settings, url, args, out)
    except sa.ProgrammingError as exc:
        if not _schema_missing(exc):
            raise
    from services.common.db.migrate import upgrade_async

    await upgrade_async(url)
    return await _command(settings, url, args, out)


async def _command(settings: Settings, url: str, args: argparse.Namespace, out: TextIO) -> int:
    engine = make_engine(url)
    key = token_key(settings)
    work = Work(make_sessionmaker(engine))
    try:
        if args.token_command == "create":
            return await _create(work, args, key, out)
        if args.token_command == "list":
            return await _list(work, out)
        return await _revoke(work, args, out)
    finally:
        await engine.dispose()


async def _create(work: Work, args: argparse.Namespace, key: bytes | None, out: TextIO) -> int:
    expires = datetime.now(UTC) + parse_duration(args.expires) if args.expires else None
    secret = new_token()
    async with work.unit() as uow:
        token = await repo.create_token(
            uow.session, name=args.name or args.role, role=args.role,
            token_hash=hash_token(secret, key), prefix=display_prefix(secret),
            created_by=_actor(), expires_at=expires, job_id=args.job)
        await repo.audit(uow.session, actor=_actor(), token_id=None, action="token.create",
                         target_type="token", target_id=token.id,
                         detail={"name": token.name, "role": token.role, "job_id": token.job_id})
    print(f"token {token.id} ({token.name}, {token.role}"
          f"{' for job ' + token.job_id if token.job_id else ''}"
          f"{', expires ' + expires.isoformat(timespec='seconds') if expires else ''})",
          file=sys.stderr)
    print("the secret below is shown once; only its hash is stored:", file=sys.stderr)
    print(secret, file=out)
    return 0


async def _list(work: Work, out: TextIO) -> int:
    now = datetime.now(UTC)
    async with work.read() as session:
        tokens = await repo.list_tokens(session)
    print(f"{'id':32}  {'name':20} {'role':8} {'prefix':10} {'expires':20} last used", file=out)
    for t in tokens:
        state = "" if usable(t.expires_at, t.revoked_at, now) else " (expired)"
        until = t.expires_at.isoformat(timespec="seconds") if t.expires_at else "never"
        used = t.last_used_at.isoformat(timespec="seconds") if t.last_used_at else "never"
        scope = f" (job {t.job_id})" if t.job_id else ""
        print(f"{t.id:32}  {t.name[:20]:20} {t.role:8} {t.prefix:10} {until:20} {used}{state}"
              f"{scope}", file=out)
    return 0


async def _revoke(work: Work, args: argparse.Namespace, out: TextIO) -> int:
    async with work.unit() as uow:
        matches = [t for t in await repo.find_tokens(uow.session, args.token)
                   if t.revoked_at is None]
        if len(matches) != 1:
            what = "no live token" if not matches else f"{len(matches)} live tokens"
            print(f"{what} match {args.token!r}; give the full id", file=sys.stderr)
            return 1
        (token,) = matches
        token.revoked_at = datetime.now(UTC)
        await repo.audit(uow.session, actor=_actor(), token_id=None, action="token.revoke",
                         target_type="token", target_id=token.id, detail={"name": token.name})
    print(f"revoked {token.id} ({token.name}, {token.role})", file=out)
    return 0


def run(settings: Settings, args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    if args.token_command == "create":
        try:
            token_key(settings)
            check_scope(args.role, args.job)
            if args.expires:
                parse_duration(args.expires)
        except ValueError as exc:
            print(f"greyhound token create: {exc}", file=sys.stderr)
            return 2
    url, stop = database(settings)
    try:
        return asyncio.run(_run(settings, url, args, out))
    finally:
        stop()


def database(settings: Settings) -> tuple[str, Callable[[], None]]:
    """The configured database, else the data directory's embedded Postgres (started, or
    reused while it runs), and what to call when done with it."""
    if settings.database_url:
        return settings.database_url, lambda: None
    pg = EmbeddedPostgres(settings.data_dir)
    return pg.start(), pg.stop


def main(argv: list[str], settings: Settings) -> int:
    """``greyhound token ...`` on its own, without the services' command line (quicker)."""
    args = build_parser(argparse.ArgumentParser(prog="greyhound token", description=HELP)
                        ).parse_args(argv)
    return run(settings, args)
