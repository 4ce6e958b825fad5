"""The database: engine, migrations, and sessions run off the event loop.

DB calls are synchronous SQLAlchemy run in a worker thread (``Database.run``): simple,
correct on SQLite and PostgreSQL alike, and the event loop never blocks on I/O. The
schema is made only by Alembic (``Database.upgrade``), never by ``create_all``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import anyio.to_thread
from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

__all__ = ["MIGRATIONS_DIR", "Database", "alembic_config", "make_engine", "migrated"]

T = TypeVar("T")

#: The packaged Alembic scripts (env.py, versions/).
MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # SQLite ignores foreign keys unless asked; WAL lets readers run beside a writer.
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.close()


def make_engine(url: str) -> Engine:
    """An engine for ``url``; SQLite gets thread-safe connections, FKs on and a busy wait."""
    if not url.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
    event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def alembic_config(engine: Engine | None = None) -> Config:
    """An Alembic Config built in code, pointing at the packaged migrations."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if engine is not None:
        config.set_main_option("sqlalchemy.url", engine.url.render_as_string(False))
    return config


class Database:
    """Sessions on one engine. ``run`` executes a function in a transaction, in a thread."""

    def __init__(self, url: str) -> None:
        if url.startswith("sqlite:///"):
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self.engine = make_engine(url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    def upgrade(self) -> None:
        """Bring the schema to the newest migration (idempotent; blocking)."""
        config = alembic_config()
        with self.engine.begin() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, "head")

    def call(self, fn: Callable[[Session], T]) -> T:
        """Run ``fn`` in one transaction (committed if it returns); blocking."""
        with self._sessions.begin() as session:
            return fn(session)

    async def run(self, fn: Callable[[Session], T]) -> T:
        """Run ``fn`` in one transaction in a worker thread.

        Cancellation waits for the transaction to finish (it cannot be interrupted), so a
        cancelled caller leaves either all of ``fn``'s writes or none.
        """
        return await anyio.to_thread.run_sync(functools.partial(self.call, fn))

    def dispose(self) -> None:
        self.engine.dispose()


@contextlib.contextmanager
def migrated(url: str) -> Iterator[Database]:
    """A Database on ``url`` with its schema brought up to date, disposed of on exit:
    what the blocking operator commands (keys, quotas, master key rotation) work on."""
    db = Database(url)
    try:
        db.upgrade()
        yield db
    finally:
        db.dispose()
