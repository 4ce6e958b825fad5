"""The control plane's state: SQLAlchemy models, Alembic migrations, and queries."""

from __future__ import annotations

from space.control.store.db import Database
from space.control.store.repo import SandboxRecord

__all__ = ["Database", "SandboxRecord"]
