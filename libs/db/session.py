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


_DRIVERS = {  # user-facing scheme -> (async driver, sync driver)
    "postgres": ("postgresql+psycopg", "postgresql+psycopg"),
    "postgresql": ("postgresql+psycopg", "postgresql+psycopg"),
    "sqlite": ("sqlite+aiosqlite", "sqlite"),
}


def _with_driver(url: str, asynchronous: bool) -> str:
    scheme, rest = url.split("://", 1)
    drivers = _DRIVERS.get(scheme.split("+", 1)[0])
    if drivers is None:
        raise ValueError(f"unsupported DATABASE_URL scheme {scheme!r}: use postgresql:// or sqlite:///")
    return f"{drivers[0] if asynchronous else drivers[1]}://{rest}"


def async_url(url: str) -> str:
    """`postgresql://…` / `sqlite:///…` as given by users -> the async driver URL."""
    return _with_driver(url, asynchronous=True)


def sync_url(url: str) -> str:
    """The same database through a sync driver, for Alembic."""
    return _with_driver(url, asynchronous=False)


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", sync_url(url).replace("%", "%%"))
    return cfg


def migrate(url: str, revision: str = "head") -> None:
    """Bring the schema to `revision`; safe to run at every start (Alembic is idempotent)."""
    command.upgrade(alembic_config(url), revision)


# Execution option of write transactions (write_sessionmaker): on SQLite they begin with the
# database's write lock (BEGIN IMMEDIATE). SQLite ignores SELECT ... FOR UPDATE, so without it two
# read-modify-writes of one row (timings merged into a scale operation) interleave and one is lost.
WRITE_LOCK = "layercast_write_lock"


def make_engine(url: str) -> AsyncEngine:
    sqlite = url.startswith("sqlite")
    # Postgres connections can drop (a restart, a proxy's idle timeout): check each at checkout.
    # A SQLite file cannot, and the check would cost every registry call a round trip.
    engine = create_async_engine(async_url(url), pool_pre_ping=not sqlite)
    if sqlite:
        # SQLite: enforce foreign keys and let readers proceed during writes.
        @event.listens_for(engine.sync_engine, "connect")
        def _pragmas(dbapi_conn, _record):  # noqa: ANN001
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.close()
            # The driver would begin a transaction only at the first write, after the reads:
            # SQLAlchemy begins it instead (below), so a transaction's reads are inside it.
            dbapi_conn.isolation_level = None

        @event.listens_for(engine.sync_engine, "begin")
        def _begin(conn):  # noqa: ANN001
            conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(WRITE_LOCK) else "BEGIN")

    return engine


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker:
    return async_sessionmaker(engine, expire_on_commit=False)


def write_sessionmaker(engine: AsyncEngine) -> async_sessionmaker:
    """Sessions for transactions that read rows and write them back: Postgres orders them by
    row locks (with_for_update), SQLite by taking its write lock at BEGIN."""
    return async_sessionmaker(engine.execution_options(**{WRITE_LOCK: True}), expire_on_commit=False)
