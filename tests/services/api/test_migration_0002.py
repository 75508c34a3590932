"""Migration 0002 on a database that already holds a (never sent) webhook from 0001: the row
keeps its URL and stages, and is disabled since its plain secret cannot be encrypted there."""

from __future__ import annotations

from alembic import command

from services.common.db.migrate import alembic_config, upgrade
from tests.services.common.support import query


def test_old_webhooks_survive_disabled_and_downgrade_restores_them(fresh_db_url: str) -> None:
    upgrade(fresh_db_url, "0001")
    query(fresh_db_url, "insert into webhooks (id, url, secret, stages, enabled) values "
                     "('w1', 'http://x.test/', 'plain', '[\"resolved\"]'::jsonb, true)")
    upgrade(fresh_db_url)
    (row,) = query(fresh_db_url, "select url, events::text, enabled, secret_enc, format from webhooks")
    assert (row["url"], row["events"], row["enabled"], row["secret_enc"], row["format"]) == (
        "http://x.test/", '["resolved"]', False, "", "json")
    command.downgrade(alembic_config(fresh_db_url), "0001")
    (row,) = query(fresh_db_url, "select url, stages::text from webhooks")
    assert (row["url"], row["stages"]) == ("http://x.test/", '["resolved"]')
    tables = {r["tablename"] for r in query(fresh_db_url, "select tablename from pg_tables "
                                                       "where schemaname='public'")}
    assert not tables & {"api_tokens", "audit_log", "webhook_attempts"}
