"""job tokens scoped to their job

Revision ID: 0006
Revises: 0005
Create Date: 2027-02-01 09:00:00

A ``job`` token was good for every job: it could declare another job's layout (from which S2
plans are built and applied without an operator) and report another job's plan applied or
failed. A job token now names its job, and the job's routes refuse it on any other. Job tokens
made before have no job: they are refused on every job's routes until re-made with
``greyhound token create --role job --job <id>`` (nothing can tell which job they were for).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("api_tokens", sa.Column("job_id", sa.String(length=128), nullable=True))


def downgrade() -> None:
    op.drop_column("api_tokens", "job_id")
