"""run prune record

Revision ID: 0003
Revises: 0002
Create Date: 2027-01-10 09:00:00

Live pruning (analysis/pruning.py) records its word on each run in a JSON column: the last
judgment the run's configuration took part in, the decision that pruned it (the fit that decided),
or that `sweep launch --resume-pruned` resumed it. The `pruned` state needs no schema change
(states are plain strings).
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("prune", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("prune")
