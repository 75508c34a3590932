"""Migration 0003 on a database that already holds a plan from 0002: the plan keeps its status
and is marked as an operator's decision (policy approval, params version 1); the new tables come
and go with the revision."""

from __future__ import annotations

from alembic import command

from services.common.db.migrate import alembic_config, upgrade
from tests.services.common.support import query


def _tables(url: str) -> set[str]:
    return {r["tablename"] for r in query(url, "select tablename from pg_tables "
                                            "where schemaname='public'")}


def test_old_plans_survive_and_downgrade_removes_what_0003_added(fresh_db_url: str) -> None:
    upgrade(fresh_db_url, "0002")
    query(fresh_db_url, "insert into jobs (id, topology) values ('j1', '{}'::jsonb)")
    query(fresh_db_url, "insert into incidents (id, job_id, kind, status, dedup_key, severity, "
                     "summary, culprit, evidence) values ('i1', 'j1', 'compute_slow', "
                     "'validated', 'slowdown', 1.5, '', '{}'::jsonb, '{}'::jsonb)")
    query(fresh_db_url, "insert into plans (id, incident_id, job_id, strategy, params, status) values "
                     "('p1', 'i1', 'j1', 'S2', '{\"micro_batches\": [3, 5]}'::jsonb, 'approved')")
    upgrade(fresh_db_url)
    (row,) = query(fresh_db_url, "select status, policy, params_version, version, reason, "
                              "expires_at from plans")
    assert tuple(row) == ("approved", "approval", 1, None, "", None)
    assert {"plan_deliveries", "escalations"} <= _tables(fresh_db_url)
    command.downgrade(alembic_config(fresh_db_url), "0002")
    assert not {"plan_deliveries", "escalations"} & _tables(fresh_db_url)
    cols = {r["column_name"] for r in query(fresh_db_url, "select column_name from "
                                         "information_schema.columns where table_name='plans'")}
    assert cols.isdisjoint({"policy", "params_version", "version", "expires_at", "reason"})
    assert [tuple(r) for r in query(fresh_db_url, "select id, status from plans")] == [("p1", "approved")]
