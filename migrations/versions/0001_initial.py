"""Initial registry schema: workers, models, model blocks, block replicas,
instances, scale operations.

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

Json = sa.JSON().with_variant(JSONB(), "postgresql")
Ts = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("worker_id", sa.String(128), primary_key=True),
        sa.Column("data_address", sa.String(256), nullable=False),
        sa.Column("host", sa.String(256), nullable=False),
        sa.Column("leaf", sa.String(128), nullable=False),
        sa.Column("scaleup_group", sa.String(128), nullable=False),
        sa.Column("link_gbps", sa.Float, nullable=False),
        sa.Column("capacities", Json, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("registered_at", Ts, nullable=False),
        sa.Column("last_heartbeat", Ts, nullable=False),
    )
    op.create_index("ix_workers_state", "workers", ["state"])
    op.create_table(
        "models",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("path", sa.String(1024), nullable=False),
        sa.Column("arch", sa.String(64), nullable=False),
        sa.Column("n_layers", sa.Integer, nullable=False),
        sa.Column("n_blocks", sa.Integer, nullable=False),
        sa.Column("total_bytes", sa.BigInteger, nullable=False),
        sa.Column("min_instances", sa.Integer, nullable=False),
        sa.Column("max_instances", sa.Integer, nullable=False),
        sa.Column("keep_alive_s", sa.Float, nullable=False),
        sa.Column("max_queue", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", Ts, nullable=False),
    )
    op.create_index("ix_models_state", "models", ["state"])
    op.create_table(
        "model_blocks",
        sa.Column("model", sa.String(128), sa.ForeignKey("models.name", ondelete="CASCADE"), primary_key=True),
        sa.Column("block_id", sa.Integer, primary_key=True),
        sa.Column("nbytes", sa.BigInteger, nullable=False),
        sa.Column("checksum", sa.String(64), nullable=False),
        sa.Column("layer_start", sa.Integer, nullable=False),
        sa.Column("layer_end", sa.Integer, nullable=False),
    )
    op.create_table(
        "block_replicas",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("block_id", sa.Integer, nullable=False),
        sa.Column("worker_id", sa.String(128), sa.ForeignKey("workers.worker_id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("tier", sa.String(8), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("updated_at", Ts, nullable=False),
        sa.UniqueConstraint("model", "block_id", "worker_id", "tier", name="uq_replica"),
    )
    op.create_index("ix_block_replicas_model", "block_replicas", ["model"])
    op.create_index("ix_block_replicas_worker_id", "block_replicas", ["worker_id"])
    op.create_table(
        "instances",
        sa.Column("instance_id", sa.String(64), primary_key=True),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("mode", sa.String(16), nullable=False),
        sa.Column("stages", Json, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("scale_op_id", sa.String(64), nullable=True),
        sa.Column("created_at", Ts, nullable=False),
        sa.Column("ready_at", Ts, nullable=True),
        sa.Column("stopped_at", Ts, nullable=True),
    )
    op.create_index("ix_instances_model", "instances", ["model"])
    op.create_index("ix_instances_state", "instances", ["state"])
    op.create_table(
        "scale_operations",
        sa.Column("scale_op_id", sa.String(64), primary_key=True),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("direction", sa.String(8), nullable=False),
        sa.Column("reason", sa.String(512), nullable=False),
        sa.Column("from_instances", sa.Integer, nullable=False),
        sa.Column("to_instances", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("plan", Json, nullable=False),
        sa.Column("timings", Json, nullable=False),
        sa.Column("error", sa.String(2048), nullable=True),
        sa.Column("created_at", Ts, nullable=False),
        sa.Column("updated_at", Ts, nullable=False),
    )
    op.create_index("ix_scale_operations_model", "scale_operations", ["model"])
    op.create_index("ix_scale_operations_created_at", "scale_operations", ["created_at"])


def downgrade() -> None:
    for table in ("scale_operations", "instances", "block_replicas", "model_blocks", "models", "workers"):
        op.drop_table(table)
