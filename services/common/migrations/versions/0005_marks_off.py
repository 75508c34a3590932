"""ranks without GPU completion marks

Revision ID: 0005
Revises: 0004
Create Date: 2027-01-10 09:00:00

An agent's hello names the ranks whose hook found neither a CUDA runtime nor the driver API
(``AgentHello.marks_off``): their GPU times are host times. The tracker now keeps that on the
rank's row, so that every incident resting on GPU times (a slowdown's profile, a validation's
benchmarks, not only a hang) can say which of its ranks it could not time on the GPU. Existing
ranks are taken to have marks until their agent says otherwise (it does in its next hello).

The JSONB documents became typed in the same change (services.common.db.documents); their
stored shape did not change, so no row is rewritten: a value without a schema version is read
as version 0 and brought forward by the reader (services.common.db.json_document).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("ranks", sa.Column("marks_off", sa.Boolean(), server_default=sa.false(),
                                     nullable=False))


def downgrade() -> None:
    op.drop_column("ranks", "marks_off")
