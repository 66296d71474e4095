"""Each deployment names the load-monitor's scaling policy (threshold, concurrency, slo)
and its parameters.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

Json = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    # Models deployed before this revision keep the concurrency policy with the cluster's defaults.
    op.add_column("models", sa.Column("policy", sa.String(32), nullable=False, server_default="concurrency"))
    op.add_column("models", sa.Column("policy_params", Json, nullable=False, server_default="{}"))


def downgrade() -> None:
    op.drop_column("models", "policy_params")
    op.drop_column("models", "policy")
