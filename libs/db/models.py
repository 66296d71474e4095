"""SQLAlchemy models of the registry's state. Only the registry service (and
Alembic) import this package: every other service asks the registry over NATS.

Times are timezone-aware UTC timestamps; JSON columns are JSONB on Postgres.
"""

from datetime import datetime

from sqlalchemy import JSON, BigInteger, DateTime, Float, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

Json = JSON().with_variant(JSONB(), "postgresql")


class Base(DeclarativeBase):
    pass


class Worker(Base):
    __tablename__ = "workers"

    worker_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    data_address: Mapped[str] = mapped_column(String(256))
    host: Mapped[str] = mapped_column(String(256))
    leaf: Mapped[str] = mapped_column(String(128))
    scaleup_group: Mapped[str] = mapped_column(String(128), default="")
    link_gbps: Mapped[float] = mapped_column(Float)
    capacities: Mapped[dict] = mapped_column(Json)  # tier -> bytes
    bandwidths_gbps: Mapped[dict] = mapped_column(Json, default=dict, server_default="{}")  # link -> GB/s
    state: Mapped[str] = mapped_column(String(16), index=True)  # alive | dead
    registered_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    last_heartbeat: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Model(Base):
    __tablename__ = "models"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    path: Mapped[str] = mapped_column(String(1024))
    arch: Mapped[str] = mapped_column(String(64))
    n_layers: Mapped[int] = mapped_column(Integer)
    n_blocks: Mapped[int] = mapped_column(Integer)
    total_bytes: Mapped[int] = mapped_column(BigInteger)
    min_instances: Mapped[int] = mapped_column(Integer)
    max_instances: Mapped[int] = mapped_column(Integer)
    keep_alive_s: Mapped[float] = mapped_column(Float)
    max_queue: Mapped[int] = mapped_column(Integer)
    scaling_mode: Mapped[str] = mapped_column(String(32), default="layercast")
    policy: Mapped[str] = mapped_column(String(32), default="concurrency")  # the load-monitor's policy
    policy_params: Mapped[dict] = mapped_column(Json, default=dict, server_default="{}")  # parameter -> value
    ttft_slo_s: Mapped[float | None] = mapped_column(Float, nullable=True)  # None: max(2, prompt tokens / 512) s
    tpot_slo_s: Mapped[float] = mapped_column(Float, default=0.25, server_default="0.25")
    state: Mapped[str] = mapped_column(String(16), index=True)  # deployed | deleted
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class ModelBlock(Base):
    __tablename__ = "model_blocks"

    model: Mapped[str] = mapped_column(ForeignKey("models.name", ondelete="CASCADE"), primary_key=True)
    block_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    nbytes: Mapped[int] = mapped_column(BigInteger)
    checksum: Mapped[str] = mapped_column(String(64))
    layer_start: Mapped[int] = mapped_column(Integer)
    layer_end: Mapped[int] = mapped_column(Integer)


class BlockReplica(Base):
    __tablename__ = "block_replicas"
    __table_args__ = (UniqueConstraint("model", "block_id", "worker_id", "tier", name="uq_replica"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(128), index=True)
    block_id: Mapped[int] = mapped_column(Integer)
    worker_id: Mapped[str] = mapped_column(ForeignKey("workers.worker_id", ondelete="CASCADE"), index=True)
    tier: Mapped[str] = mapped_column(String(8))  # gpu | host | ssd
    state: Mapped[str] = mapped_column(String(16))  # loading | ready | evicted
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Instance(Base):
    __tablename__ = "instances"

    instance_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    model: Mapped[str] = mapped_column(String(128), index=True)
    mode: Mapped[str] = mapped_column(String(16))  # local | pipeline
    stages: Mapped[list] = mapped_column(Json)  # [{worker_id, block_start, block_end}]
    state: Mapped[str] = mapped_column(String(16), index=True)
    scale_op_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    ready_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    loaded_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    max_batch: Mapped[int | None] = mapped_column(Integer, nullable=True)
    device: Mapped[str] = mapped_column(String(16), default="cpu", server_default="cpu")  # cpu | cuda
    stopped_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class ModelProfileRow(Base):
    """A model's measured iteration times on one device kind (LLM-Mesh §5.2), replaced by each
    new measurement. No foreign key: a deleted model's profiles stay for its redeploy."""

    __tablename__ = "model_profiles"

    model: Mapped[str] = mapped_column(String(128), primary_key=True)
    device: Mapped[str] = mapped_column(String(16), primary_key=True)  # cpu | cuda
    prefill_lengths: Mapped[list] = mapped_column(Json)
    prefill_s: Mapped[list] = mapped_column(Json)
    batches: Mapped[list] = mapped_column(Json)
    lengths: Mapped[list] = mapped_column(Json)
    decode_s: Mapped[list] = mapped_column(Json)  # len(batches) rows of len(lengths) seconds
    measured_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    source: Mapped[str] = mapped_column(Text, default="", server_default="")  # a worker id, or "cli"


class ScaleOperation(Base):
    __tablename__ = "scale_operations"

    scale_op_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    model: Mapped[str] = mapped_column(String(128), index=True)
    direction: Mapped[str] = mapped_column(String(8))  # up | down
    reason: Mapped[str] = mapped_column(String(512))
    from_instances: Mapped[int] = mapped_column(Integer)
    to_instances: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))
    plan: Mapped[dict] = mapped_column(Json)
    timings: Mapped[dict] = mapped_column(Json)  # event -> unix seconds
    error: Mapped[str | None] = mapped_column(String(2048), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class ApiKey(Base):
    """An API key: its SHA-256 only, never the secret (the gateway shows that once, at creation)."""

    __tablename__ = "api_keys"

    key_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), index=True)
    prefix: Mapped[str] = mapped_column(String(16))  # the secret's first characters, for display
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the secret
    models: Mapped[list | None] = mapped_column(Json, nullable=True)  # None: every model
    requests_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)  # None: unlimited
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class KeyUsage(Base):
    """Running totals per key and model. No foreign key: the gateway's static keys (key_id
    "static") are accounted here too, and a revoked key's usage stays."""

    __tablename__ = "key_usage"

    key_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    model: Mapped[str] = mapped_column(String(128), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
