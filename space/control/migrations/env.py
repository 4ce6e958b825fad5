"""Alembic environment: runs on the connection handed over in ``config.attributes``.

space.control.store.db builds the Alembic Config in code and passes an open
connection, so no alembic.ini is needed; the URL option is a fallback for the
``alembic`` command line.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine

from space.control.store.models import Base


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        # SQLite cannot ALTER most constraints: later migrations go through batch mode.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def _main() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = context.config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no connection and no sqlalchemy.url for the migrations")
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            _run(conn)
    finally:
        engine.dispose()


_main()
