"""LLM-Mesh sharing: each deployment's SLOs (TTFT, TPOT), the device kind an instance runs on,
and the measured performance profile of a model per device kind.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

Json = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    # Deployments before this revision get the paper's defaults (TTFT from the prompt length,
    # 0.25 s per output token); instances before it ran on CPU unless a worker says otherwise.
    op.add_column("models", sa.Column("ttft_slo_s", sa.Float(), nullable=True))
    op.add_column("models", sa.Column("tpot_slo_s", sa.Float(), nullable=False, server_default="0.25"))
    op.add_column("instances", sa.Column("device", sa.String(16), nullable=False, server_default="cpu"))
    # No foreign key to models: a profile outlives its model's deletion (a redeploy reuses it).
    op.create_table(
        "model_profiles",
        sa.Column("model", sa.String(128), primary_key=True),
        sa.Column("device", sa.String(16), primary_key=True),
        sa.Column("prefill_lengths", Json, nullable=False),
        sa.Column("prefill_s", Json, nullable=False),
        sa.Column("batches", Json, nullable=False),
        sa.Column("lengths", Json, nullable=False),
        sa.Column("decode_s", Json, nullable=False),
        sa.Column("measured_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("source", sa.Text(), nullable=False, server_default=""),
    )


def downgrade() -> None:
    op.drop_table("model_profiles")
    op.drop_column("instances", "device")
    op.drop_column("models", "tpot_slo_s")
    op.drop_column("models", "ttft_slo_s")
