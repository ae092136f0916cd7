"""attempt provenance

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03 07:30:00

Each attempt records where it ran and with what code (recipe/telemetry/provenance.py): a JSON column.
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("provenance", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("provenance")
