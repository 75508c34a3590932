"""plans with a lifecycle: policy, expiry, the job's delivery version, cost, revert; the deliveries
sent to each job; the planner's escalation state

Revision ID: 0003
Revises: 0002
Create Date: 2027-01-15 09:00:00

Plans written before this revision (nothing wrote them but tests) keep their status; they get
``policy = 'approval'`` (an operator decided them) and ``params_version = 1``.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from services.common.migrations.column_ops import JSONB, add_filled_column

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None



def upgrade() -> None:
    add_filled_column("plans", sa.Column("params_version", sa.Integer(), nullable=False), "1")
    add_filled_column("plans", sa.Column("policy", sa.String(length=16), nullable=False), "'approval'")
    op.add_column("plans", sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("plans", sa.Column("version", sa.Integer(), nullable=True))
    op.add_column("plans", sa.Column("cost_s", sa.Float(), nullable=True))
    op.add_column("plans", sa.Column("reverted_at", sa.DateTime(timezone=True), nullable=True))
    add_filled_column("plans", sa.Column("reason", sa.Text(), nullable=False), "''")
    op.create_index("ix_plans_job_status", "plans", ["job_id", "status"], unique=False)
    op.create_table(
        "plan_deliveries",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("plan_id", sa.String(length=32), nullable=False),
        sa.Column("action", sa.String(length=16), nullable=False),
        sa.Column("message", JSONB, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), server_default=sa.text("now()"),
                  nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=True),
        sa.Column("cost_s", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("reporter", sa.String(length=255), nullable=True),
        sa.Column("reported_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"],
                                name=op.f("fk_plan_deliveries_job_id_jobs"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["plan_id"], ["plans.id"],
                                name=op.f("fk_plan_deliveries_plan_id_plans"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_plan_deliveries")),
        sa.UniqueConstraint("job_id", "version", name=op.f("uq_plan_deliveries_job_id")),
    )
    op.create_index(op.f("ix_plan_deliveries_plan_id"), "plan_deliveries", ["plan_id"],
                    unique=False)
    op.create_table(
        "escalations",
        sa.Column("incident_id", sa.String(length=32), nullable=False),
        sa.Column("job_id", sa.String(length=128), nullable=False),
        sa.Column("state", JSONB, nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"),
                  nullable=False),
        sa.ForeignKeyConstraint(["incident_id"], ["incidents.id"],
                                name=op.f("fk_escalations_incident_id_incidents"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_escalations_job_id_jobs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("incident_id", name=op.f("pk_escalations")),
    )
    op.create_index(op.f("ix_escalations_job_id"), "escalations", ["job_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_escalations_job_id"), table_name="escalations")
    op.drop_table("escalations")
    op.drop_index(op.f("ix_plan_deliveries_plan_id"), table_name="plan_deliveries")
    op.drop_table("plan_deliveries")
    op.drop_index("ix_plans_job_status", table_name="plans")
    for column in ("reason", "reverted_at", "cost_s", "version", "expires_at", "policy",
                   "params_version"):
        op.drop_column("plans", column)
