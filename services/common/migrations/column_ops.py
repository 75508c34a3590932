"""Operations more than one migration needs. A migration is history: what is here must keep
doing exactly what it did when a migration that calls it was written; change it by adding a new
function, never by editing one."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

JSONB = postgresql.JSONB(astext_type=sa.Text())


def add_filled_column(table: str, column: sa.Column[object], default: str | None) -> None:
    """A NOT NULL column on a table that may hold rows: filled once, then no server default
    (the models supply values, as for every other column)."""
    if default is None:
        op.add_column(table, column)
        return
    column.server_default = sa.DefaultClause(sa.text(default))
    op.add_column(table, column)
    op.alter_column(table, column.name, server_default=None)
