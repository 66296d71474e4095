"""Database URLs, engines and migrations (Postgres in production, SQLite as
the embedded default of `layercast up`)."""

import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


def _split(url: str) -> tuple[str, str]:
    scheme, rest = url.split("://", 1)
    return scheme.split("+", 1)[0], rest


def async_url(url: str) -> str:
    """`postgresql://…` / `sqlite:///…` as given by users -> the async driver URL."""
    dialect, rest = _split(url)
    if dialect in ("postgres", "postgresql"):
        return f"postgresql+psycopg://{rest}"
    if dialect == "sqlite":
        return f"sqlite+aiosqlite://{rest}"
    raise ValueError(f"unsupported DATABASE_URL scheme {dialect!r}: use postgresql:// or sqlite:///")


def sync_url(url: str) -> str:
    """The same database through a sync driver, for Alembic."""
    dialect, rest = _split(url)
    if dialect in ("postgres", "postgresql"):
        return f"postgresql+psycopg://{rest}"
    if dialect == "sqlite":
        return f"sqlite://{rest}"
    raise ValueError(f"unsupported DATABASE_URL scheme {dialect!r}: use postgresql:// or sqlite:///")


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", sync_url(url).replace("%", "%%"))
    return cfg


def migrate(url: str, revision: str = "head") -> None:
    """Bring the schema to `revision`; safe to run at every start (Alembic is idempotent)."""
    command.upgrade(alembic_config(url), revision)


def make_engine(url: str) -> AsyncEngine:
    engine = create_async_engine(async_url(url), pool_pre_ping=True)
    if url.startswith("sqlite"):
        # SQLite: enforce foreign keys and let readers proceed during writes.
        @event.listens_for(engine.sync_engine, "connect")
        def _pragmas(dbapi_conn, _record):  # noqa: ANN001
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.close()

    return engine


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker:
    return async_sessionmaker(engine, expire_on_commit=False)
