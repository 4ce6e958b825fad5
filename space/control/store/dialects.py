"""What SQLite and PostgreSQL spell differently, written once (issue 19).

A read followed by an insert is not atomic under concurrent writers on either backend
(PostgreSQL runs at READ COMMITTED; SQLite takes its write lock only at the first write),
so rows that two requests or two replicas may create at once are written with one
``INSERT … ON CONFLICT``, which both backends have with the same meaning.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import DeclarativeBase, Session

__all__ = ["upsert"]


def upsert(
    session: Session,
    model: type[DeclarativeBase],
    values: Mapping[str, Any],
    keys: Sequence[str],
    update: Sequence[str] = (),
) -> None:
    """Insert ``values`` into ``model``'s table; if a row with the same ``keys`` exists,
    set its ``update`` columns to the new values instead (leave it as it is when
    ``update`` is empty). Atomic on both backends."""
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    statement = insert(model).values(**values)
    if update:
        changes = {column: statement.excluded[column] for column in update}
        statement = statement.on_conflict_do_update(index_elements=keys, set_=changes)
    else:
        statement = statement.on_conflict_do_nothing(index_elements=keys)
    session.execute(statement)
