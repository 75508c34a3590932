"""The migrate step of deploy/compose.yaml: the schema, then the first admin token.

The init step cannot write the token into the database (Postgres gets its password from init,
so it starts after it); the API could, on its first start, but then the one process that faces
users would also hold a seeding path. So init writes the token's hash and prefix (never the
secret) to the migrate step's folder, and this one-shot step, which runs after Postgres is
healthy and before any service, adds it to a database that has no token at all. A database with
tokens, revoked ones included, is left alone: a revoked first token never comes back.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from services.common.db import repository as repo
from services.common.db.migrate import upgrade
from services.common.db.session import make_engine, make_sessionmaker

ACTOR = "deploy-init"


async def seed_first_admin(database_url: str, record: dict[str, str]) -> bool:
    """Add the token of ``record`` (name, hash, prefix) as an admin if the database has no
    token; whether it did."""
    engine = make_engine(database_url)
    try:
        async with make_sessionmaker(engine)() as session:
            if await repo.list_tokens(session, include_revoked=True):
                return False
            token = await repo.create_token(session, name=record["name"], role="admin",
                                            token_hash=record["hash"], prefix=record["prefix"],
                                            created_by=ACTOR, expires_at=None)
            await repo.audit(session, actor=ACTOR, token_id=None, action="token.create",
                             target_type="token", target_id=token.id,
                             detail={"name": token.name, "role": token.role})
            await session.commit()
            return True
    finally:
        await engine.dispose()


def migrate(database_url: str, first_admin: Path) -> str:
    """What the step says in its log."""
    upgrade(database_url)
    record: dict[str, str] = json.loads(first_admin.read_text())
    if asyncio.run(seed_first_admin(database_url, record)):
        return (f"schema migrated; first admin token {record['prefix']}... added (`docker "
                "compose -f deploy/compose.yaml run --rm init admin-token` prints it)")
    return "schema migrated; the database has tokens already, none added"
