"""The database: engine, migrations, and sessions run off the event loop.

DB calls are synchronous SQLAlchemy run in a worker thread (``Database.run``): simple,
correct on SQLite and PostgreSQL alike, and the event loop never blocks on I/O. The
schema is made only by Alembic (``Database.upgrade``), never by ``create_all``.

Two backends (issue 19): ``sqlite:///PATH``, the embedded default, and
``postgresql://…`` (driven by psycopg 3, whatever driver the URL names), which every
replica of a multi-host control plane shares. The driver's errors never leave this
module as they are: a URL of another scheme is ApiError(invalid_argument), a database
that cannot be reached (or drops the connection) ApiError(unavailable), and a write a
constraint refuses ApiError(conflict).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import anyio.to_thread
from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, exc, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session, sessionmaker

from space.control.errors import ApiError

__all__ = [
    "MIGRATIONS_DIR",
    "Database",
    "alembic_config",
    "database_url",
    "make_engine",
    "migrated",
    "shown",
]

T = TypeVar("T")

#: The packaged Alembic scripts (env.py, versions/).
MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # SQLite ignores foreign keys unless asked; WAL lets readers run beside a writer.
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.close()


#: How long a PostgreSQL connection attempt may take before the database counts as
#: unreachable (libpq's connect_timeout, in whole seconds).
CONNECT_TIMEOUT_S = 10
#: The advisory lock replicas take around their migrations (an arbitrary constant:
#: "SPACE" in ASCII), so that two starting together do not both create the tables.
_MIGRATION_LOCK = 0x5350414345


def database_url(url: str) -> URL:
    """``url`` parsed, with the driver each backend is used with (psycopg 3 for
    PostgreSQL: SQLAlchemy's default for ``postgresql://`` is psycopg2).

    Raises ApiError(invalid_argument), naming the schemes accepted, for anything else.
    """
    try:
        parsed = make_url(url)
    except exc.ArgumentError:
        parsed = None
    backend = None if parsed is None else parsed.get_backend_name()
    if parsed is None or backend not in ("sqlite", "postgresql"):
        scheme = url.partition(":")[0][:40]
        raise ApiError(
            "invalid_argument",
            f"unsupported database URL (scheme {scheme!r}): use sqlite:///PATH or "
            "postgresql://USER@HOST[:PORT]/DB (or postgresql:///DB?host=/socket/dir)",
        )
    if backend == "postgresql":
        return parsed.set(drivername="postgresql+psycopg")
    return parsed


def shown(url: URL) -> str:
    """``url`` as errors and logs may show it: without its password."""
    return url.render_as_string(hide_password=True)


def make_engine(url: str) -> Engine:
    """An engine for ``url``; SQLite gets thread-safe connections, FKs on and a busy wait,
    PostgreSQL a bounded connect and connections checked before use.

    Raises ApiError(invalid_argument) for an unsupported URL (``database_url``).
    """
    parsed = database_url(url)
    if parsed.get_backend_name() == "postgresql":
        return create_engine(
            parsed, pool_pre_ping=True, connect_args={"connect_timeout": CONNECT_TIMEOUT_S}
        )
    engine = create_engine(parsed, connect_args={"check_same_thread": False, "timeout": 30})
    event.listen(engine, "connect", _sqlite_pragmas)
    return engine


@contextlib.contextmanager
def _driver_errors(url: URL) -> Iterator[None]:
    """The driver's errors as ours: unreachable or no free connection → unavailable, a
    constraint → conflict."""
    try:
        yield
    except exc.IntegrityError as error:
        raise ApiError("conflict", f"the database refused a write: {_first_line(error)}") from error
    except (exc.OperationalError, exc.InterfaceError) as error:
        raise ApiError(
            "unavailable", f"database {shown(url)} unavailable: {_first_line(error)}"
        ) from error
    except exc.TimeoutError as error:
        # Every pooled connection stayed busy for the pool's timeout (30 s).
        raise ApiError("unavailable", f"database {shown(url)} busy: {error}") from error


def _first_line(error: exc.DBAPIError) -> str:
    # The driver's own message, without SQLAlchemy's SQL and parameters (they may hold
    # tenants' data) or its link to the docs.
    return (str(error.orig).strip().splitlines() or [type(error.orig).__name__])[0][:300]


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
        """Raises ApiError(invalid_argument) for an unsupported URL; connects lazily."""
        self.engine = make_engine(url)
        path = self.engine.url.database
        if self.dialect == "sqlite" and path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @property
    def dialect(self) -> str:
        """``sqlite`` or ``postgresql``."""
        return self.engine.dialect.name

    def upgrade(self) -> None:
        """Bring the schema to the newest migration (idempotent; blocking).

        On PostgreSQL it holds an advisory lock meanwhile, so replicas starting together
        migrate one after the other (the later ones find nothing to do). Raises
        ApiError(unavailable) if the database cannot be reached.
        """
        config = alembic_config()
        with _driver_errors(self.engine.url), self.engine.begin() as connection:
            if self.dialect == "postgresql":
                lock = text("SELECT pg_advisory_xact_lock(:key)")
                connection.execute(lock, {"key": _MIGRATION_LOCK})
            config.attributes["connection"] = connection
            command.upgrade(config, "head")

    def call(self, fn: Callable[[Session], T]) -> T:
        """Run ``fn`` in one transaction (committed if it returns); blocking.

        Raises what ``fn`` raises (nothing written then), ApiError(conflict) if a
        constraint refuses its writes and ApiError(unavailable) if the database cannot
        be reached or drops the connection (the transaction then rolled back).
        """
        with _driver_errors(self.engine.url), self._sessions.begin() as session:
            return fn(session)

    def read_call(self, fn: Callable[[Session], T]) -> T:
        """Run ``fn``, which only reads, without a transaction; blocking.

        Each statement runs on its own: on PostgreSQL in autocommit, no BEGIN and no
        COMMIT (two round trips of four for a lookup, issue 21). For a single query, or
        queries that need no common snapshot; no write belongs here (PostgreSQL would
        commit it at once, SQLite would drop it). Raises what ``fn`` raises and
        ApiError(unavailable) as ``call``.
        """
        url = self.engine.url
        if self.dialect == "sqlite":
            # SQLite's driver begins no transaction for a SELECT, so a plain session sends
            # no more than that already; switching its connection to autocommit and back
            # cost more than it saved (measured: 470 against 360 us per lookup).
            with _driver_errors(url), self._sessions() as session:
                return fn(session)
        with _driver_errors(url), self.engine.connect() as connection:
            autocommit = connection.execution_options(isolation_level="AUTOCOMMIT")
            with Session(bind=autocommit) as session:
                return fn(session)

    async def read(self, fn: Callable[[Session], T]) -> T:
        """``read_call`` in a worker thread; cancellation as ``run``."""
        return await self._in_thread(functools.partial(self.read_call, fn))

    async def run(self, fn: Callable[[Session], T]) -> T:
        """Run ``fn`` in one transaction in a worker thread.

        Cancellation waits for the transaction to finish (it cannot be interrupted), so a
        cancelled caller leaves either all of ``fn``'s writes or none, and no connection
        is still out when the database is disposed of after it: anyio's own shield does
        not hold against a plain ``Task.cancel`` (a cancelled reaper left its connection
        to be collected unclosed).
        """
        return await self._in_thread(functools.partial(self.call, fn))

    @staticmethod
    async def _in_thread(work: Callable[[], T]) -> T:
        call = asyncio.ensure_future(anyio.to_thread.run_sync(work))
        cancelled = False
        while not call.done():
            try:
                await asyncio.wait({call})
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            call.exception()  # retrieved: the cancellation is what the caller hears
            raise asyncio.CancelledError
        return call.result()

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
