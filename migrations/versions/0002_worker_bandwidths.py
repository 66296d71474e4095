"""Workers report their measured load bandwidth per link (disk -> host, host -> device, network -> host).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

Json = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    # Existing rows get an empty map: "not measured yet".
    op.add_column("workers", sa.Column("bandwidths_gbps", Json, nullable=False, server_default="{}"))


def downgrade() -> None:
    op.drop_column("workers", "bandwidths_gbps")
