"""on-call surface: API tokens, audit log, acknowledgements, signed webhooks and their attempts

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 01:15:00

A later migration follows with ``down_revision = "0002"``.

Webhooks could be stored before this revision but nothing sent them; a row that has one keeps
its URL and stage list (as ``events``), and since its plain-text secret cannot be encrypted
without the key it is disabled with an empty ``secret_enc``: re-create it through the API.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from services.common.migrations.column_ops import JSONB, add_filled_column

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None



def upgrade() -> None:
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("created_by", sa.String(length=255), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"),
                  nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_tokens")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_api_tokens_token_hash")),
    )
    op.create_table(
        "audit_log",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), server_default=sa.text("now()"),
                  nullable=False),
        sa.Column("actor", sa.String(length=255), nullable=False),
        sa.Column("token_id", sa.String(length=32), nullable=True),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("target_type", sa.String(length=32), nullable=False),
        sa.Column("target_id", sa.String(length=128), nullable=False),
        sa.Column("note", sa.Text(), nullable=False),
        sa.Column("detail", JSONB, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
    )
    op.create_index(op.f("ix_audit_log_at"), "audit_log", ["at"], unique=False)
    op.create_table(
        "webhook_attempts",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("delivery_id", sa.BigInteger(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), server_default=sa.text("now()"),
                  nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("duration_ms", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["delivery_id"], ["webhook_deliveries.id"],
            name=op.f("fk_webhook_attempts_delivery_id_webhook_deliveries"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_attempts")),
    )
    op.create_index(op.f("ix_webhook_attempts_delivery_id"), "webhook_attempts", ["delivery_id"],
                    unique=False)

    op.add_column("incidents", sa.Column("acknowledged_at", sa.DateTime(timezone=True),
                                         nullable=True))
    op.add_column("incidents", sa.Column("acknowledged_by", sa.String(length=255), nullable=True))

    add_filled_column("webhook_deliveries", sa.Column("event", sa.String(length=64), nullable=False), "''")
    add_filled_column("webhook_deliveries", sa.Column("payload", JSONB, nullable=False), "'{}'::jsonb")
    op.add_column("webhook_deliveries", sa.Column(
        "created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False))
    op.add_column("webhook_deliveries", sa.Column("delivered_at", sa.DateTime(timezone=True),
                                                  nullable=True))
    op.create_index("ix_webhook_deliveries_due", "webhook_deliveries", ["status", "next_attempt_at"],
                    unique=False)

    add_filled_column("webhooks", sa.Column("name", sa.String(length=255), nullable=False), "''")
    add_filled_column("webhooks", sa.Column("secret_enc", sa.Text(), nullable=False), "''")
    add_filled_column("webhooks", sa.Column("events", JSONB, nullable=False), "'[]'::jsonb")
    add_filled_column("webhooks", sa.Column("format", sa.String(length=16), nullable=False), "'json'")
    add_filled_column("webhooks", sa.Column("created_by", sa.String(length=255), nullable=False), "''")
    op.execute("UPDATE webhooks SET events = stages, enabled = false")
    op.drop_column("webhooks", "secret")
    op.drop_column("webhooks", "stages")


def downgrade() -> None:
    add_filled_column("webhooks", sa.Column("stages", JSONB, nullable=False), "'[]'::jsonb")
    op.add_column("webhooks", sa.Column("secret", sa.String(length=255), nullable=True))
    op.execute("UPDATE webhooks SET stages = events")
    for column in ("created_by", "format", "events", "secret_enc", "name"):
        op.drop_column("webhooks", column)
    op.drop_index("ix_webhook_deliveries_due", table_name="webhook_deliveries")
    for column in ("delivered_at", "created_at", "payload", "event"):
        op.drop_column("webhook_deliveries", column)
    op.drop_column("incidents", "acknowledged_by")
    op.drop_column("incidents", "acknowledged_at")
    op.drop_index(op.f("ix_webhook_attempts_delivery_id"), table_name="webhook_attempts")
    op.drop_table("webhook_attempts")
    op.drop_index(op.f("ix_audit_log_at"), table_name="audit_log")
    op.drop_table("audit_log")
    op.drop_table("api_tokens")
