"""Each deployment has a scaling mode: layercast's own multicast choice, or a baseline
(chain, binomial, faasnet, serverlessllm, static, ideal) run in the same system.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Models deployed before this revision scale the layercast way.
    op.add_column("models", sa.Column("scaling_mode", sa.String(32), nullable=False, server_default="layercast"))


def downgrade() -> None:
    op.drop_column("models", "scaling_mode")
