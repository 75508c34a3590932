"""Migration 0008 on a database that two planners already used: duplicate open plans of one
incident and strategy are withdrawn but the one the job was sent last, so that the index can
hold; each job's plan version counter starts at its newest delivery; the revision comes off
cleanly."""

from __future__ import annotations

from alembic import command

from services.common.db.migrate import alembic_config, upgrade
from tests.services.common.support import query

PLAN = ("insert into plans (id, incident_id, job_id, strategy, params, status, policy, "
        "params_version, version, reason) values ('{id}', 'i1', 'j1', '{strategy}', "
        "'{{}}'::jsonb, '{status}', 'automatic', 1, {version}, '')")


def test_duplicate_open_plans_are_withdrawn_and_versions_counted(fresh_db_url: str) -> None:
    upgrade(fresh_db_url, "0007")
    for job in ("j1", "j2"):
        query(fresh_db_url, f"insert into jobs (id, topology) values ('{job}', '{{}}'::jsonb)")
    query(fresh_db_url, "insert into incidents (id, job_id, kind, status, dedup_key, severity, "
                     "summary, culprit, evidence) values ('i1', 'j1', 'compute_slow', "
                     "'validated', 'slowdown', 1.5, '', '{}'::jsonb, '{}'::jsonb)")
    for pid, strategy, status, version in (("sent", "S2", "approved", 2),
                                           ("twin", "S2", "proposed", "null"),
                                           ("old", "S2", "rejected", "null"),
                                           ("s3", "S3", "proposed", "null")):
        query(fresh_db_url, PLAN.format(id=pid, strategy=strategy, status=status,
                                        version=version))
    for version in (1, 2):
        query(fresh_db_url, "insert into plan_deliveries (job_id, version, plan_id, action, "
                         f"message) values ('j1', {version}, 'sent', 'apply', '{{}}'::jsonb)")
    upgrade(fresh_db_url)
    statuses = {r["id"]: r["status"] for r in query(fresh_db_url, "select id, status from plans")}
    assert statuses == {"sent": "approved", "twin": "withdrawn", "old": "rejected",
                        "s3": "proposed"}
    counters = {r["id"]: r["plan_version"]
                for r in query(fresh_db_url, "select id, plan_version from jobs")}
    assert counters == {"j1": 2, "j2": 0}
    command.downgrade(alembic_config(fresh_db_url), "0007")
    tables = {r["tablename"] for r in query(
        fresh_db_url, "select tablename from pg_tables where schemaname='public'")}
    assert "job_validations" not in tables
    assert not query(fresh_db_url, "select 1 from pg_indexes "
                                   "where indexname = 'uq_plans_open_strategy'")
