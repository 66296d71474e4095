"""An instance records when every block reached engine memory (`loaded_at`), beside
`ready_at` (serving): with serve-while-loading the two differ, and scale-out is timed by both.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-21
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("instances", sa.Column("loaded_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("instances", "loaded_at")
