"""incidents: when a slowdown was suspected and when it was confirmed

Revision ID: 0007
Revises: 0006
Create Date: 2027-02-20 09:00:00

A slowdown a short transient could explain is suspected first and confirmed once it has held
(greyhound.core.levels); an incident keeps both moments and their iterations. Rows written
before this revision have neither (NULL), which readers take as confirmed, as they were; a hang
incident has neither either (a hang is not two-stage).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("incidents", sa.Column("suspected_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("incidents", sa.Column("confirmed_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("incidents", sa.Column("suspected_iteration", sa.BigInteger(), nullable=True))
    op.add_column("incidents", sa.Column("confirmed_iteration", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    for column in ("confirmed_iteration", "suspected_iteration", "confirmed_at", "suspected_at"):
        op.drop_column("incidents", column)
