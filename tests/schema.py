"""Control-plane databases for tests at the newest schema, copied from one migrated
once per test process: running the migrations took about 90 ms of each control app's
start on SQLite, and the fast lane starts a few thousand. The migrations' own tests
take an empty database (``pytest.mark.empty_database``, tests/conftest.py).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

from sqlalchemy.engine import make_url

from space.control.store import Database

__all__ = ["at_newest_schema", "migrated_sqlite"]

_template: Path | None = None


def migrated_sqlite(path: Path) -> None:
    """Make ``path`` a SQLite database at the newest schema, unless it exists (a test's
    app started on it before)."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_sqlite_template(), path)


def at_newest_schema(database_url: str) -> None:
    """A SQLite database at ``database_url`` not made yet is made at the newest schema;
    the app's start then finds nothing to migrate. Another backend is left alone."""
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
        migrated_sqlite(Path(url.database))


def _sqlite_template() -> Path:
    global _template
    if _template is None:
        directory = Path(tempfile.mkdtemp(prefix="space-schema-"))
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        template = directory / "space.db"
        db = Database(f"sqlite:///{template}")
        try:
            db.upgrade()
        finally:
            db.dispose()  # the last connection closed: WAL checkpointed into the file
        _template = template
    return _template
