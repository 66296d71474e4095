"""An instance records how many requests its engine runs at once (`max_batch`, its KV slots):
the gateway gives it no more, so a burst waits for the first free slot on any instance.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("instances", sa.Column("max_batch", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("instances", "max_batch")
