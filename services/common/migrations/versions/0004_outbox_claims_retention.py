"""outbox, validation claims, finite severities, indexes for retention

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 09:00:00

The transactional outbox (messages that commits announce, published by a relay) and the
validator's claims (one pause per suspicion). Severities that are not finite (a detection with
``before_s=0`` once made inf, which the API could not serve) are clamped to the bound the bus
contract now enforces and a check constraint keeps them finite. Indexes on the columns the
retention pass deletes by.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MAX_SEVERITY = 1e6  # services.common.bus.bounds.MAX_SECONDS, the contract's bound on severities


def upgrade() -> None:
    op.create_table(
        "outbox",
        sa.Column("seq", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("event_id", sa.String(length=64), nullable=False),
        sa.Column("subject", sa.String(length=255), nullable=False),
        sa.Column("kind", sa.String(length=64), nullable=False),
        sa.Column("incident_id", sa.String(length=32), nullable=True),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.Column("producer", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"),
                  nullable=False),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("failed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("seq", name=op.f("pk_outbox")),
        sa.UniqueConstraint("event_id", name=op.f("uq_outbox_event_id")),
    )
    op.create_index(op.f("ix_outbox_incident_id"), "outbox", ["incident_id"], unique=False)
    op.create_index("ix_outbox_sent_at", "outbox", ["sent_at"], unique=False)
    op.create_index("ix_outbox_unsent", "outbox", ["seq"], unique=False,
                    postgresql_where=sa.text("sent_at IS NULL AND failed_at IS NULL"))
    op.create_table(
        "validation_claims",
        sa.Column("suspicion_id", sa.String(length=64), nullable=False),
        sa.Column("incident_id", sa.String(length=32), nullable=False),
        sa.Column("job_id", sa.String(length=128), nullable=False),
        sa.Column("suspicion", sa.Text(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("holder", sa.String(length=64), nullable=False),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"),
                  nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["incident_id"], ["incidents.id"],
                                name=op.f("fk_validation_claims_incident_id_incidents"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("suspicion_id", name=op.f("pk_validation_claims")),
    )
    op.create_index(op.f("ix_validation_claims_incident_id"), "validation_claims",
                    ["incident_id"], unique=False)

    op.execute(f"UPDATE incidents SET severity = CASE WHEN severity < 0 THEN 0 "
               f"ELSE {MAX_SEVERITY} END WHERE NOT (severity >= 0 AND severity < 'Infinity')")
    op.create_check_constraint("severity_finite", "incidents",
                               "severity >= 0 AND severity < 'Infinity'::float8")
    op.create_index("ix_incidents_resolved_at", "incidents", ["resolved_at"], unique=False)
    op.create_index(op.f("ix_processed_events_at"), "processed_events", ["at"], unique=False)
    op.create_index(op.f("ix_webhook_attempts_at"), "webhook_attempts", ["at"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_webhook_attempts_at"), table_name="webhook_attempts")
    op.drop_index(op.f("ix_processed_events_at"), table_name="processed_events")
    op.drop_index("ix_incidents_resolved_at", table_name="incidents")
    op.drop_constraint(op.f("ck_incidents_severity_finite"), "incidents", type_="check")
    op.drop_index(op.f("ix_validation_claims_incident_id"), table_name="validation_claims")
    op.drop_table("validation_claims")
    op.drop_index("ix_outbox_unsent", table_name="outbox",
                  postgresql_where=sa.text("sent_at IS NULL AND failed_at IS NULL"))
    op.drop_index("ix_outbox_sent_at", table_name="outbox")
    op.drop_index(op.f("ix_outbox_incident_id"), table_name="outbox")
    op.drop_table("outbox")
