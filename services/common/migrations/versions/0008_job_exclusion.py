"""per-job exclusion: one validation per job, one open plan per incident and strategy, plan
versions counted per job

Revision ID: 0008
Revises: 0007
Create Date: 2027-03-01 09:00:00

Several validators and planners share one database:

* ``job_validations``: the one validation a job is under, whichever validator runs it (a row
  with its holder and a lease), so that two validators never pause one job at once;
* ``uq_plans_open_strategy``: at most one open plan (proposed, approved, applied) per incident
  and strategy. Duplicates that two planners made before are withdrawn first, keeping the one
  the job was sent last (else the newest);
* ``jobs.plan_version``: the job's last plan version, allocated by one atomic update rather
  than read off its newest delivery (which retention may delete), starting from the newest
  delivery each job has.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OPEN_PLAN = "status IN ('proposed', 'approved', 'applied')"


def upgrade() -> None:
    op.create_table(
        "job_validations",
        sa.Column("job_id", sa.String(length=128), nullable=False),
        sa.Column("holder", sa.String(length=64), nullable=False),
        sa.Column("suspicion_id", sa.String(length=64), nullable=False),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=False),
        sa.Column("taken_at", sa.DateTime(timezone=True), server_default=sa.text("now()"),
                  nullable=False),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_job_validations")),
    )
    op.execute(f"""
        UPDATE plans SET status = 'withdrawn',
               reason = 'a duplicate of another open plan of its incident and strategy'
        WHERE id IN (
            SELECT id FROM (
                SELECT id, row_number() OVER (
                    PARTITION BY incident_id, strategy
                    ORDER BY version DESC NULLS LAST, created_at DESC, id DESC) AS n
                FROM plans WHERE {OPEN_PLAN}) ranked
            WHERE n > 1)""")
    op.create_index("uq_plans_open_strategy", "plans", ["incident_id", "strategy"], unique=True,
                    postgresql_where=sa.text(OPEN_PLAN))
    op.add_column("jobs", sa.Column("plan_version", sa.Integer(), server_default="0",
                                    nullable=False))
    op.execute("""
        UPDATE jobs SET plan_version = newest.version
        FROM (SELECT job_id, max(version) AS version FROM plan_deliveries GROUP BY job_id) newest
        WHERE newest.job_id = jobs.id""")


def downgrade() -> None:
    op.drop_column("jobs", "plan_version")
    op.drop_index("uq_plans_open_strategy", table_name="plans",
                  postgresql_where=sa.text(OPEN_PLAN))
    op.drop_table("job_validations")
